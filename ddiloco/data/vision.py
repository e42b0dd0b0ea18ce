"""Image pipelines over scikit-learn's handwritten digits: split, shard, shuffle, augment, batch.

The data are the 1,797 8 x 8 grey images of `sklearn.datasets.load_digits` (10 classes), which
scikit-learn ships inside its package, so nothing downloads at run time. Pixels (0..16) are scaled to
[0, 1] and laid out NHWC: images [N, 8, 8, 1] float32, labels [N] int32.

Split (fixed, deterministic, class-balanced): for every class, its last ceil(eval_fraction * n_c)
images in dataset order are held out. With the default 0.2 that is 364 eval and 1,433 train images.

Sharding and order (docs/algorithm.md §1: every learner owns its data shard), as the text pipeline: train example
j (in ascending dataset order) belongs to shard j % num_shards; each shard is reshuffled every epoch
with a permutation seeded by (seed, num_shards, shard_index, epoch), repeated forever, and batches
run on across epoch boundaries. A grain `MapDataset` whose element k is batch k (the ids, then one
vectorized gather), so the iterator state is grain's batch index.

Augmentation (train only): each image is shifted by a random integer offset in
[-max_shift, max_shift] along each axis (zero fill) and gets Gaussian intensity noise of std
`noise_std`, clipped to [0, 1]. Shifts are off by default: with 2 x 2 patches a one-pixel shift
re-cuts every patch, and at the step counts we run it slows learning a lot (measured, one learner,
480 steps of 32 images, tiny ViT: 77 % eval accuracy with ±1 shifts and noise, 90 % with noise
only). It is a grain `random_map`: batch k's generator is derived from the
shard's seed and k, so a restored iterator reproduces the same augmented batches, and an image seen
again in a later epoch (at another batch index) gets a different augmentation.

Batches are {"inputs": float32 [B, 8, 8, 1], "targets": int32 [B]}: the number of elements of
"targets" is the number of examples, the merge weight unit of a vision task (docs/algorithm.md §4.4).
"""

import dataclasses
import functools
import math

import grain
import numpy as np

from ddiloco.data.sharding import CheckedShardIterator, ShardBatchIds
from ddiloco.types import check_int_fields

IMAGE_SIZE = 8
CHANNELS = 1
NUM_CLASSES = 10
NUM_IMAGES = 1797
_MAX_PIXEL = 16.0
Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionDataConfig:
  """What an image pipeline reads and how it batches and augments.

  Attributes:
    batch_size: images per batch; `make_train_iterator(batch_size=...)` overrides it per learner.
    eval_fraction: held-out share of every class, in (0, 1).
    seed: shuffle and augmentation seed, in [0, 2**32).
    max_shift: largest random shift in pixels along each axis (0: no shifts).
    noise_std: std of the Gaussian intensity noise on [0, 1] pixels (0: none).
    num_threads: grain reader threads; 0 reads in the caller's thread.
    prefetch_buffer_size: batches grain prefetches when num_threads > 0.
  """

  batch_size: int = 32
  eval_fraction: float = 0.2
  seed: int = 0
  max_shift: int = 0
  noise_std: float = 0.05
  num_threads: int = 0
  prefetch_buffer_size: int = 0

  def __post_init__(self):
    check_int_fields(self)  # A gin typo such as 4.5 fails here, not mid-run.
    if self.batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {self.batch_size}.")
    if not 0.0 < self.eval_fraction < 1.0:
      raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}.")
    if not 0 <= self.seed < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {self.seed}.")
    if not 0 <= self.max_shift < IMAGE_SIZE:
      raise ValueError(f"max_shift must be in [0, {IMAGE_SIZE}), got {self.max_shift}.")
    if not (self.noise_std >= 0 and math.isfinite(self.noise_std)):
      raise ValueError(f"noise_std must be finite and >= 0, got {self.noise_std}.")
    if self.num_threads < 0 or self.prefetch_buffer_size < 0:
      raise ValueError("num_threads and prefetch_buffer_size must be >= 0.")


@functools.lru_cache(maxsize=1)
def load_digits() -> tuple[np.ndarray, np.ndarray]:
  """Returns the digits as (images float32 [1797, 8, 8, 1] in [0, 1], labels int32 [1797]).

  Both arrays are read-only (cached and shared by every caller in the process).

  Raises:
    ImportError: if scikit-learn is not installed.
  """
  try:  # Heavy import, only when used; the `vision` extra.
    from sklearn.datasets import load_digits as sklearn_load_digits
  except ImportError as e:
    raise ImportError("The digits data need scikit-learn: pip install 'ddiloco[vision]'.") from e

  digits = sklearn_load_digits()
  images = (digits.images / _MAX_PIXEL).astype(np.float32)[..., None]
  labels = digits.target.astype(np.int32)
  images.flags.writeable = False
  labels.flags.writeable = False
  return images, labels


@functools.lru_cache(maxsize=8)
def _split(eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  _, labels = load_digits()
  held_out = np.zeros(labels.size, dtype=bool)
  for c in range(NUM_CLASSES):
    ids = np.flatnonzero(labels == c)
    held_out[ids[ids.size - math.ceil(eval_fraction * ids.size) :]] = True
  train, held = np.flatnonzero(~held_out), np.flatnonzero(held_out)
  train.flags.writeable = False
  held.flags.writeable = False
  return train, held


def split_ids(config: VisionDataConfig) -> tuple[np.ndarray, np.ndarray]:
  """Returns (train ids, eval ids), ascending and disjoint; the eval ids never depend on the seed."""
  return _split(config.eval_fraction)


def shard_example_ids(config: VisionDataConfig, *, shard_index: int, num_shards: int) -> np.ndarray:
  """Returns one shard's train example ids: train ids at positions j with j % num_shards == index.

  Raises:
    ValueError: if not 0 <= shard_index < num_shards, or the shard would hold no image.
  """
  if num_shards < 1 or not 0 <= shard_index < num_shards:
    raise ValueError(f"need 0 <= shard_index < num_shards, got {shard_index} and {num_shards}.")
  ids = split_ids(config)[0][shard_index::num_shards]
  if ids.size == 0:
    raise ValueError(f"shard {shard_index} of {num_shards} holds no training image.")
  return ids


def augment(
  images_BxHxWxC: np.ndarray, rng: np.random.Generator, *, max_shift: int, noise_std: float
) -> np.ndarray:
  """Random integer shifts (zero fill) and clipped Gaussian intensity noise, one draw per image.

  Output pixel (i, j) of image b is input pixel (i + dy_b, j + dx_b), or 0 outside the image.
  """
  b, h, w, _ = images_BxHxWxC.shape
  out = images_BxHxWxC
  if max_shift > 0:
    m = max_shift
    padded = np.pad(images_BxHxWxC, ((0, 0), (m, m), (m, m), (0, 0)))
    dy_B, dx_B = rng.integers(-m, m + 1, size=(2, b))
    rows_BxH = (m + dy_B)[:, None] + np.arange(h)
    cols_BxW = (m + dx_B)[:, None] + np.arange(w)
    out = padded[np.arange(b)[:, None, None], rows_BxH[:, :, None], cols_BxW[:, None, :]]
  if noise_std > 0:
    noise = rng.normal(0.0, noise_std, size=out.shape).astype(np.float32)
    out = np.clip(out + noise, 0.0, 1.0)
  return np.ascontiguousarray(out, dtype=np.float32)


class _GatherAugment(grain.transforms.RandomMap):
  """Example ids [B] -> augmented {"inputs", "targets"} with one vectorized gather."""

  def __init__(self, config: VisionDataConfig):
    self._images, self._labels = load_digits()
    self._max_shift = config.max_shift
    self._noise_std = config.noise_std

  def random_map(self, element: np.ndarray, rng: np.random.Generator) -> Batch:
    images = augment(
      self._images[element], rng, max_shift=self._max_shift, noise_std=self._noise_std
    )
    return {"inputs": images, "targets": self._labels[element].copy()}


class VisionTrainIterator(CheckedShardIterator):
  """The vision pipeline's checked shard iterator (`sharding.CheckedShardIterator`)."""


def make_train_iterator(
  config: VisionDataConfig, *, shard_index: int, num_shards: int, batch_size: int | None = None
) -> VisionTrainIterator:
  """Returns an endless, augmented, checkpointable iterator over one shard of the train split.

  Args:
    config: the data config.
    shard_index: this learner's shard, in [0, num_shards).
    num_shards: number of shards (learners).
    batch_size: overrides `config.batch_size` (heterogeneous learners, docs/algorithm.md §6).

  Returns:
    A grain DatasetIterator yielding {"inputs": float32 [B, 8, 8, 1], "targets": int32 [B]}.

  Raises:
    ValueError: for a bad shard or batch size.
  """
  batch_size = config.batch_size if batch_size is None else batch_size
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
  ids = shard_example_ids(config, shard_index=shard_index, num_shards=num_shards)
  seed_key = (config.seed, num_shards, shard_index)
  source = ShardBatchIds(ids, batch_size=batch_size, seed_key=seed_key)
  # One 32-bit seed per shard for grain's per-element generators (derived from the seed and k).
  augment_seed = int(np.random.SeedSequence([*seed_key, 1]).generate_state(1)[0])
  dataset = grain.MapDataset.source(source).random_map(_GatherAugment(config), seed=augment_seed)
  read_options = grain.ReadOptions(
    num_threads=config.num_threads, prefetch_buffer_size=config.prefetch_buffer_size
  )
  identity = {
    "dataset": "digits",
    "eval_fraction": config.eval_fraction,
    "seed": config.seed,
    "max_shift": config.max_shift,
    "noise_std": config.noise_std,
    "shard_index": shard_index,
    "num_shards": num_shards,
    "batch_size": batch_size,
  }
  return VisionTrainIterator(iter(dataset.to_iter_dataset(read_options)), identity)


def eval_batches(
  config: VisionDataConfig, *, num_batches: int, batch_size: int | None = None
) -> list[Batch]:
  """Returns fixed batches of held-out images (no augmentation), spread evenly over the eval split.

  Eval example j of the num_batches * B is eval id floor(j * n / (num_batches * B)), as the text
  pipeline spreads its windows, so every class is represented.

  Raises:
    ValueError: if the eval split holds fewer than num_batches * B images.
  """
  batch_size = config.batch_size if batch_size is None else batch_size
  if num_batches < 1 or batch_size < 1:
    raise ValueError(f"num_batches and batch_size must be >= 1, got {num_batches}, {batch_size}.")
  held = split_ids(config)[1]
  wanted = num_batches * batch_size
  if wanted > held.size:
    raise ValueError(
      f"eval split holds {held.size} images; {num_batches} x {batch_size} = {wanted} requested."
    )
  ids = held[np.arange(wanted, dtype=np.int64) * held.size // wanted]
  images, labels = load_digits()
  return [
    {"inputs": images[chunk].copy(), "targets": labels[chunk].copy()}
    for chunk in ids.reshape(num_batches, batch_size)
  ]
