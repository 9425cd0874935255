"""pyspec: speculative decoding with token trees, tree attention over paged KV and lossless
acceptance sampling. The algorithms live in the C++ core (``pyspec._C``); this package adds
validation, defaults, the model layer, the drafters, the engine and the API.

    import pyspec
    llm = pyspec.LLM()                                   # embedded default model + drafter
    print(llm.generate("Hello!", pyspec.SamplingParams(max_tokens=32))[0].text)
"""

from pyspec import _C
from pyspec._C import TokenTree
from pyspec import ops
from pyspec.ops import cuda_available
from pyspec.engine import Engine, Router, StepError
from pyspec.llm import LLM, SpecConfig, generate
from pyspec.outputs import Completion, GenerationOutput, StreamChunk
from pyspec.params import SamplingParams

__version__ = _C.__version__

__all__ = ["LLM", "StepError", "SpecConfig", "SamplingParams", "GenerationOutput", "Completion", "StreamChunk",
           "generate", "Engine", "Router", "TokenTree", "ops", "cuda_available", "__version__"]
