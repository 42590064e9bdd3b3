"""Tile configurations for the kernel templates and their default heuristic."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Tiles and launch parameters of the parallel (flash-style) templates.

  block_q: query rows per program; block_k: key rows per inner-loop step;
  num_warps / num_stages: Triton launch and software-pipelining depth.
  """
  block_q: int = 128
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 3

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "AttentionConfig":
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def next_power_of_2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def clamp_block(block: int, length: int, minimum: int = 16) -> int:
  """Shrinks a block to the (power-of-two padded) length for short sequences."""
  return max(minimum, min(block, next_power_of_2(length)))


def heuristic_config(seq_q: int, seq_kv: int, d_qk: int, d_v: int, *,
                     block_sparse: bool = False, itemsize: int = 2) -> AttentionConfig:
  """A reasonable default without tuning (Hopper-class GPUs, Triton).

  Head dims count as padded to powers of two (>= 16). Up to 256 + 128
  (e.g. Dqk 192, Dv 128) the 128x64 tiles with 3 stages still fit shared
  memory (measured on an H200: 1.04x vanilla's rate, against 0.81x with the
  small tiles); only larger heads fall back to 64x32. Under a mask_mod
  (`block_sparse`), heads of up to 128 take 128-wide key blocks: programs
  are shorter there, and fewer, longer loop steps pay (H200, B4 H16 d128,
  kernel time: causal 0.754 -> 0.714 ms at S=4k, 2.55 -> 2.36 ms at 16k,
  where the dense time is 1.33 / 4.92 ms; the tuner picked these tiles for
  sliding windows and for causal at 16k too).

  float32 inputs (`itemsize` 4) with heads over 64 take 64x64 tiles on two
  stages: the 16-bit tiles ask for 384 KB of shared memory there, over
  Hopper's 227 KB (seen on an H100, 2026-11-23).
  """
  d_qk, d_v = (max(16, next_power_of_2(d)) for d in (d_qk, d_v))
  if itemsize > 2 and max(d_qk, d_v) > 64:
    cfg = AttentionConfig(block_q=64, block_k=64, num_warps=4, num_stages=2)
  elif max(d_qk, d_v) <= 64:
    cfg = AttentionConfig(block_q=128, block_k=64, num_warps=4, num_stages=3)
  elif d_qk + d_v <= 384:
    wide_keys = block_sparse and max(d_qk, d_v) <= 128
    cfg = AttentionConfig(block_q=128, block_k=128 if wide_keys else 64, num_warps=8,
                          num_stages=3)
  else:
    cfg = AttentionConfig(block_q=64, block_k=32, num_warps=4, num_stages=2)
  return dataclasses.replace(
      cfg,
      block_q=clamp_block(cfg.block_q, seq_q),
      block_k=clamp_block(cfg.block_k, seq_kv))


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
  """Tiles of the chunked-recurrent (linear attention) templates.

  chunk_size: tokens per chunk (intra-chunk part runs as dense matmuls);
  block_v: Dv columns per program; num_warps / num_stages as above. These
  tile the parallel (output and gradient) passes; the sequential state pass
  sizes its own tiles and stages from the shape (`state_tile`,
  `state_pass_stages` in kernels/linear/chunked_forward.py).
  """
  chunk_size: int = 64
  block_v: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "LinearAttentionConfig":
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})
