"""The package's kernel templates by role; importing this module registers them all.

Each template lives next to its kernel and registers itself in
schedule/template.py's registry when its module is imported, which this
module does for every one. The attention passes come per lowering
(kernels/lowering.py's names): `FORWARD[lowering]`, `BACKWARD[lowering]`;
besides the Template interface, each pass's template has its `lowering`
and `obstacle(analysis, dtype, d_qk, d_v, interpret)`, why that lowering
cannot run a call (None where it can).
"""
from pallas_attn.kernels import mosaic_forward, parallel_forward
from pallas_attn.kernels.decode_forward import TEMPLATE as DECODE
from pallas_attn.kernels.linear.chunked_forward import TEMPLATE as LINEAR_FORWARD
from pallas_attn.kernels.linear.delta_rule import PER_FEATURE_TEMPLATE as DELTA_RULE_PER_FEATURE
from pallas_attn.kernels.linear.delta_rule import TEMPLATE as DELTA_RULE
from pallas_attn.kernels.lowering import MOSAIC_GPU, TRITON
from pallas_attn.vjp import mosaic_backward, parallel_backward
from pallas_attn.vjp.linear_backward import TEMPLATE as LINEAR_BACKWARD

FORWARD = {t.lowering: t for t in (parallel_forward.TEMPLATE, mosaic_forward.TEMPLATE)}
BACKWARD = {t.lowering: t for t in (parallel_backward.TEMPLATE, mosaic_backward.TEMPLATE)}

# The templates `pallas_attn.tuning.tune_attention` tunes (`attention`'s
# passes and the split-KV forward), in the order the CLI lists them.
ATTENTION = (FORWARD[TRITON], BACKWARD[TRITON], FORWARD[MOSAIC_GPU], BACKWARD[MOSAIC_GPU],
             DECODE)
