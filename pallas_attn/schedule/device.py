"""What the scheduler knows about the accelerator: the one place for hardware numbers.

Every CUDA- or ROCm-specific number the resource model and the search space
use lives in `DEVICE_TABLE`. The running device is identified from JAX
(`device_kind`, and `core_count` where the backend exposes it); a device the
table does not name falls back to a conservative entry of its vendor. The
"cpu" entry stands for Pallas interpret mode: no on-chip limits, and launch
parameters (warps, stages) that have no effect.
"""
from __future__ import annotations

import dataclasses

import jax

KiB = 1024


@dataclasses.dataclass(frozen=True)
class DeviceConfig:
  """Limits of one program (thread block) on a device, as the Triton path sees them.

  smem_per_block: bytes of shared memory (LDS on AMD) one program may use,
    the opt-in maximum; None where there is no limit (interpret mode).
  registers_per_sm: 32-bit registers per SM (per CU on AMD), or None.
  max_registers_per_thread: the per-thread register cap, or None.
  warp_size: threads per warp (wavefront on AMD).
  mma_tile: (m, n, k) of the smallest tensor-core (MFMA) instruction tile
    `tl.dot` uses; tiles must be multiples of it.
  sm_count: streaming multiprocessors (compute units), or None if unknown.
  num_warps_choices / num_stages_choices: the launch parameters worth
    searching on this device.
  max_threads_per_block: warps x warp size a program may launch.
  kind: the device kind string JAX reports (the cache's device key).
  """
  name: str
  vendor: str  # "nvidia" | "amd" | "cpu"
  smem_per_block: int | None
  registers_per_sm: int | None
  max_registers_per_thread: int | None
  warp_size: int
  mma_tile: tuple[int, int, int]
  sm_count: int | None
  num_warps_choices: tuple[int, ...]
  num_stages_choices: tuple[int, ...]
  max_threads_per_block: int = 1024
  kind: str = ""

  @property
  def interpret(self) -> bool:
    """True for the interpret-mode entry, where tiles have no hardware cost."""
    return self.vendor == "cpu"


def _nvidia(name: str, smem_kib: int, sm_count: int | None) -> DeviceConfig:
  # All NVIDIA GPUs since Volta: 64K registers per SM, at most 255 per thread,
  # 32-thread warps; `tl.dot` falls back to mma.sync m16n8k16 below a Hopper
  # warpgroup tile, so that is the base tile on every generation.
  return DeviceConfig(
      name=name, vendor="nvidia", smem_per_block=smem_kib * KiB,
      registers_per_sm=65536, max_registers_per_thread=255, warp_size=32,
      mma_tile=(16, 8, 16), sm_count=sm_count, num_warps_choices=(4, 8),
      num_stages_choices=(1, 2, 3, 4))


def _amd(name: str, sm_count: int | None) -> DeviceConfig:
  # CDNA2/CDNA3: 64 KiB LDS per workgroup; 4 SIMDs x 512 VGPRs x 64 lanes per
  # CU, at most 512 (VGPR + AGPR) per lane; 64-wide wavefronts; MFMA 16x16x16.
  # Triton's AMD pipeliner uses one or two stages.
  return DeviceConfig(
      name=name, vendor="amd", smem_per_block=64 * KiB,
      registers_per_sm=4 * 512 * 64, max_registers_per_thread=512, warp_size=64,
      mma_tile=(16, 16, 16), sm_count=sm_count, num_warps_choices=(4, 8),
      num_stages_choices=(1, 2))


DEVICE_TABLE: dict[str, DeviceConfig] = {
    "b200": _nvidia("b200", 227, 148),
    "h200": _nvidia("h200", 227, 132),
    "h100": _nvidia("h100", 227, 132),  # SXM; PCIe has 114 SMs (core_count says)
    "a100": _nvidia("a100", 163, 108),
    "nvidia": _nvidia("nvidia", 99, None),  # unknown NVIDIA: the sm_86/89 limit
    "mi300": _amd("mi300", 304),  # MI300X; MI300A has 228 CUs
    "mi250": _amd("mi250", 110),  # per GCD (JAX sees one device per GCD)
    "amd": _amd("amd", None),
    "cpu": DeviceConfig(
        name="cpu", vendor="cpu", smem_per_block=None, registers_per_sm=None,
        max_registers_per_thread=None, warp_size=32, mma_tile=(16, 16, 16),
        sm_count=None, num_warps_choices=(4,), num_stages_choices=(1,)),
}

# Substrings of a lower-cased device kind, most specific first.
_KIND_PATTERNS = (
    ("b200", "b200"), ("h200", "h200"), ("h100", "h100"), ("a100", "a100"),
    ("mi300", "mi300"), ("mi325", "mi300"), ("mi250", "mi250"),
    ("mi210", "mi250"), ("amd", "amd"), ("instinct", "amd"), ("radeon", "amd"),
    ("nvidia", "nvidia"), ("cpu", "cpu"),
)


def lookup_device(kind: str) -> DeviceConfig:
  """The table entry for a device kind string (e.g. "NVIDIA H100 80GB HBM3").

  An unrecognised kind gets the generic NVIDIA entry, the conservative GPU
  choice; pass "cpu" for the interpret-mode entry.
  """
  lowered = kind.lower()
  name = next((n for pattern, n in _KIND_PATTERNS if pattern in lowered), "nvidia")
  return dataclasses.replace(DEVICE_TABLE[name], kind=kind)


def device_config(device=None) -> DeviceConfig:
  """The config of `device` (default: JAX's first device), refined by what JAX exposes."""
  device = jax.devices()[0] if device is None else device
  if device.platform == "cpu":
    return dataclasses.replace(DEVICE_TABLE["cpu"], kind=device.device_kind)
  config = lookup_device(device.device_kind)
  if config.vendor == "nvidia" and str(
      getattr(device, "compute_capability", "")).startswith("gfx"):
    config = dataclasses.replace(DEVICE_TABLE["amd"], kind=device.device_kind)
  core_count = getattr(device, "core_count", None)
  if isinstance(core_count, int) and core_count > 0:
    config = dataclasses.replace(config, sm_count=core_count)
  return config


def current_device_kind() -> str:
  """The device kind string of JAX's first device (a cache-key field)."""
  return jax.devices()[0].device_kind
