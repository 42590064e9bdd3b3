"""Layers for model libraries, each imported on first use so that pallas_attn
needs neither library: `pallas_attn.layers.flax` (flax.nnx / linen; extra
`flax`) and `pallas_attn.layers.equinox` (extra `equinox`)."""
import importlib

_FRAMEWORKS = ("flax", "equinox")


def __getattr__(name):
  if name in _FRAMEWORKS:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
