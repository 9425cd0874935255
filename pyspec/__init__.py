"""pyspec: speculative decoding with token trees, tree attention over paged KV and lossless
acceptance sampling. The algorithms live in the C++ core (``pyspec._C``); this package adds
validation, defaults and the model layer."""

from pyspec import _C
from pyspec._C import TokenTree
from pyspec import ops
from pyspec.ops import cuda_available

__version__ = _C.__version__

__all__ = ["TokenTree", "ops", "cuda_available", "__version__"]
