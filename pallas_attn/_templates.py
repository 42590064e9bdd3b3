"""The package's kernel templates by role; importing this module registers them all.

Each template lives next to its kernel and registers itself in
schedule/template.py's registry when its module is imported, which this
module does for every one. The attention passes come per lowering
(kernels/lowering.py's names): `FORWARD[lowering]`, `BACKWARD[lowering]`;
besides the Template interface, each pass's template has its `lowering`
and `obstacle(analysis, dtype, d_qk, d_v, interpret)`, why that lowering
cannot run a call (None where it can).

Where each family's parts live (forward in kernels/, backward in vjp/, the
dense reference it is tested against, the config dataclass it tunes):

  parallel attention   kernels/parallel_forward.py (Triton), kernels/mosaic_forward.py
                       (Mosaic GPU); vjp/parallel_backward.py, vjp/mosaic_backward.py,
                       vjp/attention_vjp.py (the custom_vjp); reference.py;
                       schedule/config.py AttentionConfig
  split-KV decoding    kernels/decode_forward.py (forward only); reference.py;
                       DecodeConfig
  chunked linear       kernels/linear/chunked_forward.py (Triton), kernels/linear/
                       mosaic_forward.py (Mosaic GPU, one kernel); vjp/linear_backward.py;
                       kernels/linear/reference.py; LinearAttentionConfig
  delta rule           kernels/linear/delta_rule.py (+ triangular.py) on the chunked
                       passes; vjp/delta_rule_backward.py; kernels/linear/reference.py;
                       LinearAttentionConfig
"""
from pallas_attn.kernels import mosaic_forward, parallel_forward
from pallas_attn.kernels.decode_forward import TEMPLATE as DECODE
from pallas_attn.kernels.linear.chunked_forward import TEMPLATE as LINEAR_FORWARD
from pallas_attn.kernels.linear.delta_rule import TEMPLATES as DELTA_RULE  # by decay kind
from pallas_attn.kernels.lowering import MOSAIC_GPU, TRITON
from pallas_attn.vjp import mosaic_backward, parallel_backward
from pallas_attn.vjp.linear_backward import TEMPLATE as LINEAR_BACKWARD

FORWARD = {t.lowering: t for t in (parallel_forward.TEMPLATE, mosaic_forward.TEMPLATE)}
BACKWARD = {t.lowering: t for t in (parallel_backward.TEMPLATE, mosaic_backward.TEMPLATE)}

# The templates `pallas_attn.tuning.tune_attention` tunes (`attention`'s
# passes and the split-KV forward), in the order the CLI lists them.
ATTENTION = (FORWARD[TRITON], BACKWARD[TRITON], FORWARD[MOSAIC_GPU], BACKWARD[MOSAIC_GPU],
             DECODE)
