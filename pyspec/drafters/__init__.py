"""Draft methods behind one interface (:class:`Drafter`): n-gram / prompt lookup, a corpus of the
target's earlier answers (suffix), an independent draft model, self-speculative layer skipping,
Medusa heads and EAGLE heads with dynamic trees, and their combinations.

:func:`make_drafter` (:mod:`pyspec.drafters.spec`) turns a spec string (``"ngram"``,
``"default"``, ``"eagle@width=3"``, ``"ngram|DIR"``, ...) into a drafter; the drafter folder
format is :mod:`pyspec.drafters.folder`.
"""

from pyspec.drafters.base import Draft, Drafter, DraftRequest, PrefillChunk, Verified
from pyspec.drafters.folder import read_config, target_mismatch
from pyspec.drafters.heads import EagleDrafter, MedusaDrafter, load_heads, save_heads
from pyspec.drafters.merged import FirstDrafter, MergedDrafter, merge_drafts
from pyspec.drafters.model import LayerSkipDrafter, ModelDrafter
from pyspec.drafters.ngram import NgramDrafter
from pyspec.drafters.spec import DRAFT_CHOICES, is_draft_model_folder, make_drafter, split_spec
from pyspec.drafters.suffix import SuffixDrafter

__all__ = ["Drafter", "Draft", "DraftRequest", "PrefillChunk", "Verified", "NgramDrafter",
           "SuffixDrafter", "ModelDrafter", "LayerSkipDrafter", "MedusaDrafter", "EagleDrafter",
           "MergedDrafter", "FirstDrafter", "merge_drafts", "make_drafter", "split_spec",
           "is_draft_model_folder", "load_heads", "save_heads", "read_config", "target_mismatch",
           "DRAFT_CHOICES"]
