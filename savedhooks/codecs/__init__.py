"""Ready-made codecs: what a saved tensor becomes between forward and backward."""

from savedhooks.codecs.base import Codec
from savedhooks.codecs.bitmask import Bitmask, bitmask
from savedhooks.codecs.centered import Centered
from savedhooks.codecs.downcast import Downcast, downcast
from savedhooks.codecs.fp8 import Float8, fp8
from savedhooks.codecs.indices import PoolIndices
from savedhooks.codecs.int8 import Int8Blocks, Int8Rows
from savedhooks.codecs.offload import Offload, offload
from savedhooks.codecs.policy import DEFAULT_KEEP_OPS, Policy, policy, producing_op

__all__ = [
    "DEFAULT_KEEP_OPS",
    "Bitmask",
    "Centered",
    "Codec",
    "Downcast",
    "Float8",
    "Int8Blocks",
    "Int8Rows",
    "Offload",
    "Policy",
    "PoolIndices",
    "bitmask",
    "downcast",
    "fp8",
    "offload",
    "policy",
    "producing_op",
]
