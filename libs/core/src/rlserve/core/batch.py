"""The batch container every rlserve service passes around.

A `Batch` holds one PPO batch as three parts:

- `tensors`: named tensors that all share dim 0, the batch size (`[batch, ...]`);
- `non_tensors`: named per-sample Python values, one list of length `batch` per key
  (ground-truth strings, data-source names); values are str/int/float/bool/None;
- `meta`: batch-wide scalars (`weights_version`, `step`), not indexed by row.

It plays the role of VeRL's `DataProto`, with these choices:

- Validation happens once, in the constructor, and every operation returns a new
  `Batch` (nothing mutates in place), so a `Batch` you hold stays consistent as long as
  you do not edit its dicts yourself. Tensor and non-tensor keys share one namespace,
  so `batch[key]` is never ambiguous.
- Non-tensor data is plain lists rather than numpy object arrays: they encode to
  protobuf/JSON directly and compare with `==`.
- `split` / `collect` are the one place that decides data-parallel dispatch: pad by
  repeating rows from the start up to a multiple of the worker count, split evenly,
  then concatenate the results and drop the padded rows. An empty batch splits into
  empty chunks (pad count 0) rather than raising, so callers need no special case.
- Batch size is read from the fields; a batch without per-sample fields (meta only)
  has size 0 and can be merged by `union` into a batch of any size.
- Pickled (Ray's transport to and from workers), each tensor travels as a numpy byte
  view of its own elements, which pickle protocol 5 hands over out of band: Ray writes
  it into its object store once, a view ships only its rows (a chunk of `split` does
  not carry the whole storage, as a pickled torch tensor would), and the receiver makes
  one copy it owns, so a tensor never aliases read-only shared memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

# Types allowed as non-tensor values and as meta values (JSON-like scalars).
_SCALAR_TYPES = (str, int, float, bool, type(None))

Indices = torch.Tensor | Sequence[int] | slice


class Batch:
    """Named tensors and per-sample values sharing one batch dimension, plus meta.

    Args:
        tensors: name -> tensor, each of shape `[batch, ...]` (at least 1-D).
        non_tensors: name -> list of `batch` values (str/int/float/bool/None).
        meta: name -> batch-wide scalar (str/int/float/bool/None).

    Raises:
        ValueError: sizes disagree, a tensor is 0-dim, or a key is both a tensor and a
            non-tensor key.
        TypeError: a value has an unsupported type.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Sequence[Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.non_tensors: dict[str, list[Any]] = {
            key: list(values) for key, values in (non_tensors or {}).items()
        }
        self.meta: dict[str, Any] = dict(meta or {})
        self._batch_size = self._validate()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _unpickle_batch, (
            {key: _tensor_parts(t) for key, t in self.tensors.items()},
            self.non_tensors,
            self.meta,
        )

    def _validate(self) -> int:
        """Check types and sizes; return the batch size."""
        first_key: str | None = None
        size = 0
        for key, tensor in self.tensors.items():
            _check_key(key, "tensor")
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"tensor {key!r} must be a torch.Tensor, got {type(tensor)}")
            if tensor.dim() == 0:
                raise ValueError(f"tensor {key!r} is 0-dim; tensors need a batch dimension")
            if first_key is None:
                first_key, size = key, tensor.shape[0]
            elif tensor.shape[0] != size:
                raise ValueError(
                    f"tensor {key!r} has batch size {tensor.shape[0]} but {first_key!r} has {size}"
                )
        for key, values in self.non_tensors.items():
            _check_key(key, "non-tensor")
            if key in self.tensors:
                raise ValueError(f"key {key!r} is both a tensor and a non-tensor key")
            if first_key is None:
                first_key, size = key, len(values)
            elif len(values) != size:
                raise ValueError(
                    f"non-tensor {key!r} has batch size {len(values)} but {first_key!r} has {size}"
                )
            for i, value in enumerate(values):
                if not isinstance(value, _SCALAR_TYPES):
                    raise TypeError(
                        f"non-tensor {key!r} row {i} has type {type(value).__name__}; "
                        "allowed: str, int, float, bool, None"
                    )
        for key, value in self.meta.items():
            _check_key(key, "meta")
            if not isinstance(value, _SCALAR_TYPES):
                raise TypeError(
                    f"meta {key!r} has type {type(value).__name__}; "
                    "allowed: str, int, float, bool, None"
                )
        return size

    # ---- access -------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Number of rows (dim 0 of every tensor, length of every non-tensor list)."""
        return self._batch_size

    def __len__(self) -> int:
        return self._batch_size

    def keys(self) -> list[str]:
        """Tensor keys, then non-tensor keys (meta keys are in `meta`)."""
        return [*self.tensors, *self.non_tensors]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key: str) -> torch.Tensor | list[Any]:
        """The tensor (`[batch, ...]`) or non-tensor list (length `batch`) named `key`."""
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"no key {key!r}; available: {self.keys()}")

    # A Batch is not a Mapping (len counts rows, not keys): make `for x in batch` fail
    # clearly instead of falling back to __getitem__(0).
    __iter__ = None

    def __repr__(self) -> str:
        tensors = ", ".join(
            f"{key}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            for key, t in self.tensors.items()
        )
        return (
            f"Batch(size={self._batch_size}, tensors={{{tensors}}}, "
            f"non_tensors={list(self.non_tensors)}, meta={self.meta})"
        )

    # ---- subsets ------------------------------------------------------------------

    def select(
        self,
        tensor_keys: Sequence[str] | None = None,
        non_tensor_keys: Sequence[str] | None = None,
        meta_keys: Sequence[str] | None = None,
    ) -> Batch:
        """A new Batch with only the given keys; `None` keeps all of that kind.

        Tensors are shared, not copied. Raises KeyError naming the missing key.
        """
        return Batch(
            tensors=_pick(self.tensors, tensor_keys, "tensor"),
            non_tensors=_pick(self.non_tensors, non_tensor_keys, "non-tensor"),
            meta=_pick(self.meta, meta_keys, "meta"),
        )

    def index(self, indices: Indices) -> Batch:
        """A new Batch with rows `indices`, in that order (repeats allowed).

        Args:
            indices: a slice, a list of ints, or a 1-D integer tensor `[k]`; negative
                values count from the end. A slice with positive step gives views.

        Raises:
            TypeError: indices of another kind (a bool mask, a single int).
            IndexError: an index is out of range.
        """
        if isinstance(indices, slice) and (indices.step is None or indices.step > 0):
            return Batch(
                tensors={key: t[indices] for key, t in self.tensors.items()},
                non_tensors={key: v[indices] for key, v in self.non_tensors.items()},
                meta=self.meta,
            )
        idx = self._index_tensor(indices)
        rows = idx.tolist()
        return Batch(
            tensors={key: t[idx.to(t.device)] for key, t in self.tensors.items()},
            non_tensors={key: [v[i] for i in rows] for key, v in self.non_tensors.items()},
            meta=self.meta,
        )

    def reorder(self, indices: Indices) -> Batch:
        """A new Batch with rows permuted: row `i` of the result is row `indices[i]`.

        Raises ValueError unless `indices` is a permutation of `range(len(self))`.
        """
        idx = self._index_tensor(indices)
        if not torch.equal(idx.sort().values, torch.arange(self._batch_size)):
            raise ValueError(
                f"reorder needs a permutation of range({self._batch_size}), got {idx.tolist()}"
            )
        return self.index(idx)

    def _index_tensor(self, indices: Indices) -> torch.Tensor:
        """`indices` as a validated, non-negative 1-D int64 CPU tensor."""
        n = self._batch_size
        if isinstance(indices, slice):
            return torch.arange(*indices.indices(n), dtype=torch.int64)
        if isinstance(indices, torch.Tensor):
            if indices.dtype == torch.bool or indices.is_floating_point():
                raise TypeError(
                    f"indices must be an integer tensor, got dtype {indices.dtype}"
                    " (for a bool mask use mask.nonzero().squeeze(1))"
                )
            if indices.dim() != 1:
                raise TypeError(f"indices must be 1-D, got shape {list(indices.shape)}")
            idx = indices.to("cpu", torch.int64)
        elif isinstance(indices, Sequence) and not isinstance(indices, str):
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
                raise TypeError(f"indices must be ints, got {list(indices)!r}")
            idx = torch.tensor(list(indices), dtype=torch.int64)
        else:
            raise TypeError(
                f"indices must be a slice, list of ints or 1-D int tensor, got {type(indices)}"
            )
        if idx.numel() and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"indices out of range for batch size {n}: {idx.tolist()}")
        return idx % n if n else idx

    # ---- combining ----------------------------------------------------------------

    def union(self, other: Batch) -> Batch:
        """A new Batch with the keys of both.

        Sizes must match, unless one side has no per-sample fields (meta only). A key in
        both must hold equal values (same dtype and shape, exact values, NaN == NaN),
        and so must a meta key in both; otherwise ValueError names the key.
        """
        if self.keys() and other.keys() and len(self) != len(other):
            raise ValueError(f"union needs equal batch sizes, got {len(self)} and {len(other)}")
        tensors = dict(self.tensors)
        for key, t in other.tensors.items():
            if key in tensors and not _same_tensor(tensors[key], t):
                raise ValueError(f"tensor {key!r} differs between the two batches")
            tensors.setdefault(key, t)
        non_tensors = dict(self.non_tensors)
        for key, values in other.non_tensors.items():
            if key in non_tensors and non_tensors[key] != values:
                raise ValueError(f"non-tensor {key!r} differs between the two batches")
            non_tensors.setdefault(key, values)
        meta = dict(self.meta)
        for key, value in other.meta.items():
            if key in meta and meta[key] != value:
                raise ValueError(f"meta {key!r} differs: {meta[key]!r} vs {value!r}")
            meta[key] = value
        return Batch(tensors, non_tensors, meta)

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all `batches`, in order, as one Batch.

        All batches need the same tensor keys (each with the same dtype, device and
        trailing shape `[...]`), the same non-tensor keys, and equal meta.
        Raises ValueError naming the offending key.
        """
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for i, batch in enumerate(batches[1:], start=1):
            _check_same_keys("tensor", first.tensors, batch.tensors, i)
            _check_same_keys("non-tensor", first.non_tensors, batch.non_tensors, i)
            _check_same_keys("meta", first.meta, batch.meta, i)
            for key, t0 in first.tensors.items():
                t = batch.tensors[key]
                if t.dtype != t0.dtype:
                    raise ValueError(
                        f"tensor {key!r} has dtype {t0.dtype} in batch 0 but {t.dtype} in batch {i}"
                    )
                if t.shape[1:] != t0.shape[1:]:
                    raise ValueError(
                        f"tensor {key!r} has trailing shape {list(t0.shape[1:])} in batch 0 "
                        f"but {list(t.shape[1:])} in batch {i}"
                    )
                if t.device != t0.device:
                    raise ValueError(
                        f"tensor {key!r} is on {t0.device} in batch 0 "
                        f"but on {t.device} in batch {i}"
                    )
            for key, value in first.meta.items():
                if batch.meta[key] != value:
                    raise ValueError(
                        f"meta {key!r} is {value!r} in batch 0 but {batch.meta[key]!r} in batch {i}"
                    )
        if len(batches) == 1:
            return Batch(first.tensors, first.non_tensors, first.meta)
        return Batch(
            tensors={key: torch.cat([b.tensors[key] for b in batches]) for key in first.tensors},
            non_tensors={
                key: [v for b in batches for v in b.non_tensors[key]] for key in first.non_tensors
            },
            meta=first.meta,
        )

    # ---- data-parallel dispatch -------------------------------------------------------

    def split(self, n_chunks: int) -> tuple[list[Batch], int]:
        """Split into `n_chunks` equal chunks for data-parallel workers.

        If the size is not a multiple of `n_chunks`, rows are first repeated from the
        start (row 0, 1, ..., wrapping around) up to the next multiple. An empty batch
        gives `n_chunks` empty chunks. Undo with `Batch.collect(chunks, pad_count)`.

        Returns:
            `(chunks, pad_count)`: each chunk has `ceil(batch / n_chunks)` rows;
            `pad_count` rows were appended.
        """
        if not isinstance(n_chunks, int) or n_chunks <= 0:
            raise ValueError(f"n_chunks must be a positive int, got {n_chunks!r}")
        n = self._batch_size
        pad_count = -n % n_chunks
        padded = self
        if pad_count:
            padded = self.index(torch.arange(n + pad_count) % n)
        rows = len(padded) // n_chunks
        chunks = [padded.index(slice(i * rows, (i + 1) * rows)) for i in range(n_chunks)]
        return chunks, pad_count

    @staticmethod
    def collect(chunks: Sequence[Batch], pad_count: int) -> Batch:
        """Inverse of `split`: concatenate `chunks` and drop the last `pad_count` rows."""
        batch = Batch.concat(chunks)
        if not 0 <= pad_count <= len(batch):
            raise ValueError(f"pad_count must be in [0, {len(batch)}], got {pad_count}")
        if pad_count == 0:
            return batch
        return batch.index(slice(0, len(batch) - pad_count))

    def chunk(self, max_rows: int) -> Iterator[Batch]:
        """Yield consecutive micro-batches of at most `max_rows` rows (views, no padding).

        An empty batch yields nothing.
        """
        if not isinstance(max_rows, int) or max_rows <= 0:
            raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
        for start in range(0, self._batch_size, max_rows):
            yield self.index(slice(start, start + max_rows))

    def to(self, device: torch.device | str) -> Batch:
        """A new Batch with every tensor moved to `device`."""
        return Batch(
            tensors={key: t.to(device) for key, t in self.tensors.items()},
            non_tensors=self.non_tensors,
            meta=self.meta,
        )


def _check_key(key: object, kind: str) -> None:
    if not isinstance(key, str):
        raise TypeError(f"{kind} keys must be str, got {key!r}")


def _pick(fields: dict[str, Any], keys: Sequence[str] | None, kind: str) -> dict[str, Any]:
    """`fields` restricted to `keys` (all when None); KeyError names a missing key."""
    if keys is None:
        return dict(fields)
    if isinstance(keys, str):
        raise TypeError(f"{kind} keys must be a sequence of str, got the str {keys!r}")
    for key in keys:
        if key not in fields:
            raise KeyError(f"no {kind} key {key!r}; available: {list(fields)}")
    return {key: fields[key] for key in keys}


def _check_same_keys(kind: str, first: Mapping[str, Any], other: Mapping[str, Any], i: int) -> None:
    """Raise ValueError naming a key in one of batch 0 / batch `i` but not the other."""
    for key in first:
        if key not in other:
            raise ValueError(f"{kind} {key!r} is in batch 0 but missing from batch {i}")
    for key in other:
        if key not in first:
            raise ValueError(f"{kind} {key!r} is in batch {i} but missing from batch 0")


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and values (NaN equals NaN), on any devices."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    b = b.to(a.device)
    if a.is_floating_point() or a.is_complex():
        return torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    return torch.equal(a, b)


def _tensor_parts(tensor: torch.Tensor) -> tuple[np.ndarray, str, tuple[int, ...], str]:
    """(its elements as a uint8 array viewing the tensor's memory, dtype, shape, device);
    numpy cannot hold bfloat16, bytes can."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    dtype = str(tensor.dtype).removeprefix("torch.")
    return flat.view(torch.uint8).numpy(), dtype, tuple(tensor.shape), str(tensor.device)


def _unpickle_batch(
    parts: dict[str, tuple[np.ndarray, str, tuple[int, ...], str]],
    non_tensors: dict[str, list[Any]],
    meta: dict[str, Any],
) -> Batch:
    tensors = {}
    for key, (data, dtype, shape, device) in parts.items():
        if data.size == 0:  # an empty array's stride is 0: torch cannot view its bytes
            tensors[key] = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            continue
        # A buffer Ray read from its object store is read-only shared memory: copy it.
        owned = data if data.flags.writeable and data.base is None else data.copy()
        flat = torch.from_numpy(owned).view(getattr(torch, dtype))
        tensors[key] = flat.reshape(shape).to(device)
    return Batch(tensors, non_tensors, meta)
