"""pyspec: speculative decoding with token trees, tree attention over paged KV and lossless
acceptance sampling. The algorithms live in the C++ core (``pyspec._C``); this package adds
validation, defaults, the model layer, the drafters, the engine and the API.

    import pyspec
    llm = pyspec.LLM()                                   # embedded default model + drafter
    print(llm.generate("Hello!", pyspec.SamplingParams(max_tokens=32))[0].text)
"""

try:
    from pyspec import _C
except ImportError as _e:  # the source tree, not the installed package, is on the path
    import importlib.util as _util
    import os as _os

    _here = _os.path.dirname(_os.path.abspath(__file__))
    if _util.find_spec("pyspec._C") is not None or \
            not _os.path.isfile(_os.path.join(_os.path.dirname(_here), "pyproject.toml")):
        raise  # a core that is there (an editable install's too) but does not load: its error
    raise ImportError(
        f"pyspec's compiled core (pyspec._C) is not in {_here}: Python is importing the source "
        f"checkout instead of the installed package (it is on the path because the current "
        f"directory or PYTHONPATH is the repository). Run from another directory, or install it "
        f"editable for development (docs/cpp.md, 'development')") from _e
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
