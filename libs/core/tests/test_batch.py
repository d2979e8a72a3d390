"""Tests for rlserve.core.batch.Batch (CPU only, fast)."""

import pickle
import random

import pytest
import torch

from rlserve.core.batch import Batch


def make_batch(n: int, seq: int = 3, meta: dict | None = None) -> Batch:
    """A batch of `n` rows where row i is recognisable in every field."""
    return Batch(
        tensors={
            "input_ids": torch.arange(n * seq, dtype=torch.int64).reshape(n, seq),
            "scores": torch.arange(n, dtype=torch.float32) / 2,
        },
        non_tensors={"ground_truth": [f"gt{i}" for i in range(n)], "idx": list(range(n))},
        meta={"weights_version": 3} if meta is None else meta,
    )


def assert_same(a: Batch, b: Batch) -> None:
    """Field-by-field exact equality, dtypes included."""
    assert a.tensors.keys() == b.tensors.keys()
    for key in a.tensors:
        assert a.tensors[key].dtype == b.tensors[key].dtype, key
        assert torch.equal(a.tensors[key], b.tensors[key]), key
    assert a.non_tensors == b.non_tensors
    assert a.meta == b.meta


# ---- construction ---------------------------------------------------------------------


def test_construct_and_access():
    b = make_batch(4)
    assert len(b) == b.batch_size == 4
    assert b.keys() == ["input_ids", "scores", "ground_truth", "idx"]
    assert b["input_ids"].shape == (4, 3)
    assert b["ground_truth"] == ["gt0", "gt1", "gt2", "gt3"]
    assert "scores" in b and "weights_version" not in b
    with pytest.raises(KeyError, match=r"'nope'.*available.*input_ids"):
        b["nope"]


def test_tensor_sizes_mismatch():
    with pytest.raises(
        ValueError, match=r"tensor 'attention_mask' has batch size 3 but 'input_ids' has 4"
    ):
        Batch(tensors={"input_ids": torch.zeros(4, 2), "attention_mask": torch.zeros(3, 2)})


def test_tensor_non_tensor_size_mismatch():
    with pytest.raises(ValueError, match=r"non-tensor 'gt' has batch size 3 but 'x' has 4"):
        Batch(tensors={"x": torch.zeros(4)}, non_tensors={"gt": ["a", "b", "c"]})


def test_non_tensor_sizes_mismatch():
    with pytest.raises(ValueError, match=r"non-tensor 'b' has batch size 1 but 'a' has 2"):
        Batch(non_tensors={"a": [1, 2], "b": [1]})


def test_zero_dim_tensor_rejected():
    with pytest.raises(ValueError, match=r"tensor 'loss' is 0-dim"):
        Batch(tensors={"loss": torch.tensor(1.0)})


def test_bad_types_rejected():
    with pytest.raises(TypeError, match=r"tensor 'x' must be a torch.Tensor"):
        Batch(tensors={"x": [1, 2]})
    with pytest.raises(TypeError, match=r"non-tensor 'gt' row 1 has type dict"):
        Batch(non_tensors={"gt": ["a", {"b": 1}]})
    with pytest.raises(TypeError, match=r"meta 'cfg' has type list"):
        Batch(meta={"cfg": [1]})
    with pytest.raises(ValueError, match=r"'x' is both a tensor and a non-tensor key"):
        Batch(tensors={"x": torch.zeros(1)}, non_tensors={"x": [1]})


def test_empty_batches():
    assert len(Batch()) == 0
    assert len(Batch(meta={"step": 1})) == 0
    empty = Batch(tensors={"x": torch.zeros(0, 5)}, non_tensors={"gt": []})
    assert len(empty) == 0
    with pytest.raises(ValueError, match=r"non-tensor 'gt' has batch size 1 but 'x' has 0"):
        Batch(tensors={"x": torch.zeros(0, 5)}, non_tensors={"gt": ["a"]})


def test_constructor_copies_containers():
    gt = ["a", "b"]
    tensors = {"x": torch.zeros(2)}
    b = Batch(tensors=tensors, non_tensors={"gt": gt})
    gt.append("c")
    tensors["y"] = torch.zeros(5)
    assert b["gt"] == ["a", "b"] and b.keys() == ["x", "gt"]


def test_not_iterable():
    with pytest.raises(TypeError):
        iter(make_batch(2))


def test_repr_is_short():
    text = repr(make_batch(2))
    assert text == (
        "Batch(size=2, tensors={input_ids: int64[2, 3], scores: float32[2]}, "
        "non_tensors=['ground_truth', 'idx'], meta={'weights_version': 3})"
    )


# ---- select / index / reorder ---------------------------------------------------------


def test_select():
    b = make_batch(3, meta={"weights_version": 3, "step": 7})
    s = b.select(tensor_keys=["scores"], non_tensor_keys=[], meta_keys=["step"])
    assert s.keys() == ["scores"] and s.meta == {"step": 7} and len(s) == 3
    assert s["scores"] is b["scores"]
    # None keeps everything of that kind.
    assert b.select(tensor_keys=["input_ids"]).keys() == ["input_ids", "ground_truth", "idx"]
    with pytest.raises(KeyError, match=r"no tensor key 'values'; available: \['input_ids'"):
        b.select(tensor_keys=["values"])
    with pytest.raises(KeyError, match=r"no non-tensor key 'x'"):
        b.select(non_tensor_keys=["x"])
    with pytest.raises(KeyError, match=r"no meta key 'x'"):
        b.select(meta_keys=["x"])


@pytest.mark.parametrize(
    "indices",
    [[2, 0, 0], torch.tensor([2, 0, 0]), torch.tensor([2, 0, 0], dtype=torch.int32), [-2, 0, -4]],
)
def test_index_lists_and_tensors(indices):
    b = make_batch(4)
    out = b.index(indices)
    assert out["idx"] == [2, 0, 0]
    assert torch.equal(out["input_ids"], b["input_ids"][[2, 0, 0]])
    assert out.meta == b.meta


def test_index_slices():
    b = make_batch(6)
    assert b.index(slice(1, 5, 2))["idx"] == [1, 3]
    assert b.index(slice(None, None, -1))["idx"] == [5, 4, 3, 2, 1, 0]
    assert torch.equal(b.index(slice(None, None, -2))["scores"], b["scores"][[5, 3, 1]])
    assert len(b.index(slice(4, 2))) == 0
    assert len(b.index([])) == 0


def test_index_errors():
    b = make_batch(3)
    with pytest.raises(IndexError, match="out of range for batch size 3"):
        b.index([3])
    with pytest.raises(IndexError, match="out of range"):
        b.index(torch.tensor([-4]))
    with pytest.raises(TypeError, match="integer tensor"):
        b.index(torch.tensor([True, False, True]))
    with pytest.raises(TypeError, match="1-D"):
        b.index(torch.tensor([[0]]))
    with pytest.raises(TypeError, match="ints"):
        b.index([0.0])
    with pytest.raises(TypeError):
        b.index(1)


def test_reorder():
    b = make_batch(4)
    out = b.reorder([3, 1, 0, 2])
    assert out["ground_truth"] == ["gt3", "gt1", "gt0", "gt2"]
    assert torch.equal(out["scores"], torch.tensor([1.5, 0.5, 0.0, 1.0]))
    assert b["idx"] == [0, 1, 2, 3]  # original untouched
    # Inverse permutation restores the original.
    perm = torch.randperm(4, generator=torch.Generator().manual_seed(0))
    assert_same(b.reorder(perm).reorder(perm.argsort()), b)
    for bad in ([0, 1, 2], [0, 0, 1, 2], [0, 1, 2, 3, 0]):
        with pytest.raises(ValueError, match=r"permutation of range\(4\)"):
            b.reorder(bad)


# ---- union ----------------------------------------------------------------------------


def test_union():
    b = make_batch(3)
    extra = Batch(
        tensors={"values": torch.ones(3, 2), "scores": b["scores"].clone()},
        non_tensors={"source": ["gsm8k"] * 3},
        meta={"step": 1, "weights_version": 3},
    )
    out = b.union(extra)
    assert out.keys() == ["input_ids", "scores", "values", "ground_truth", "idx", "source"]
    assert out.meta == {"weights_version": 3, "step": 1}
    assert b.keys() == ["input_ids", "scores", "ground_truth", "idx"]  # not mutated
    # NaN equals NaN for the shared-key check.
    nan = Batch(tensors={"lp": torch.tensor([float("nan"), 1.0])})
    assert len(nan.union(Batch(tensors={"lp": torch.tensor([float("nan"), 1.0])}))) == 2
    # A meta-only batch merges into any size.
    assert b.union(Batch(meta={"step": 2})).meta == {"weights_version": 3, "step": 2}
    assert Batch(meta={"step": 2}).union(b).meta == {"step": 2, "weights_version": 3}


def test_union_conflicts():
    b = make_batch(3)
    with pytest.raises(ValueError, match="equal batch sizes, got 3 and 2"):
        b.union(make_batch(2))
    with pytest.raises(ValueError, match="tensor 'scores' differs"):
        b.union(Batch(tensors={"scores": torch.zeros(3)}))
    with pytest.raises(ValueError, match="tensor 'scores' differs"):  # same values, other dtype
        b.union(Batch(tensors={"scores": b["scores"].double()}))
    with pytest.raises(ValueError, match="non-tensor 'ground_truth' differs"):
        b.union(Batch(non_tensors={"ground_truth": ["x", "y", "z"]}))
    with pytest.raises(ValueError, match=r"meta 'weights_version' differs: 3 vs 4"):
        b.union(Batch(meta={"weights_version": 4}))
    with pytest.raises(ValueError, match="both a tensor and a non-tensor key"):
        b.union(Batch(non_tensors={"scores": [1, 2, 3]}))


# ---- concat ---------------------------------------------------------------------------


def test_concat():
    parts = [make_batch(2), make_batch(0), make_batch(3)]
    out = Batch.concat(parts)
    assert len(out) == 5
    assert out["idx"] == [0, 1, 0, 1, 2]
    assert torch.equal(out["scores"], torch.tensor([0.0, 0.5, 0.0, 0.5, 1.0]))
    assert out.meta == {"weights_version": 3}
    assert_same(Batch.concat([parts[0]]), parts[0])


def test_concat_errors():
    b = make_batch(2)
    with pytest.raises(ValueError, match="at least one batch"):
        Batch.concat([])
    with pytest.raises(ValueError, match=r"tensor 'scores' is in batch 0 but missing from batch 1"):
        Batch.concat([b, b.select(tensor_keys=["input_ids"])])
    with pytest.raises(ValueError, match=r"tensor 'values' is in batch 1 but missing from batch 0"):
        Batch.concat([b, b.union(Batch(tensors={"values": torch.zeros(2)}))])
    with pytest.raises(ValueError, match=r"non-tensor 'idx' is in batch 0 but missing from batch"):
        Batch.concat([b, b.select(non_tensor_keys=["ground_truth"])])
    other_dtype = Batch(
        tensors={**b.tensors, "scores": b["scores"].double()},
        non_tensors=b.non_tensors,
        meta=b.meta,
    )
    with pytest.raises(
        ValueError,
        match=r"tensor 'scores' has dtype torch.float32 in batch 0 but torch.float64 in batch 2",
    ):
        Batch.concat([b, b, other_dtype])
    other_shape = make_batch(2, seq=4)
    with pytest.raises(
        ValueError, match=r"tensor 'input_ids' has trailing shape \[3\] in batch 0 but \[4\]"
    ):
        Batch.concat([b, other_shape])
    with pytest.raises(
        ValueError, match=r"meta 'weights_version' is 3 in batch 0 but 4 in batch 1"
    ):
        Batch.concat([b, make_batch(2, meta={"weights_version": 4})])
    with pytest.raises(ValueError, match=r"meta 'step' is in batch 1 but missing from batch 0"):
        Batch.concat([b, make_batch(2, meta={"weights_version": 3, "step": 1})])


# ---- split / collect / chunk ----------------------------------------------------------


@pytest.mark.parametrize("size", range(0, 12))
@pytest.mark.parametrize("n_chunks", range(1, 6))
def test_split_collect_round_trip(size, n_chunks):
    b = make_batch(size)
    chunks, pad_count = b.split(n_chunks)
    assert len(chunks) == n_chunks
    assert pad_count == -size % n_chunks
    rows = (size + pad_count) // n_chunks
    assert all(len(c) == rows for c in chunks)
    assert all(c.meta == b.meta for c in chunks)
    # Padding rows repeat the batch from its start, wrapping around.
    if size:
        padded = Batch.concat(chunks)
        assert padded["idx"] == [i % size for i in range(size + pad_count)]
    assert_same(Batch.collect(chunks, pad_count), b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_a_pickled_chunk_carries_only_its_rows_and_comes_back_owned(dtype):
    batch = Batch(
        tensors={"x": torch.randn(40, 500).to(dtype), "ids": torch.arange(40)},
        non_tensors={"text": [str(i) for i in range(40)]},
        meta={"m": 1},
    )
    chunks, _ = batch.split(4)
    pickled = pickle.dumps(chunks[1], protocol=5)
    as_torch_pickles_it = pickle.dumps(chunks[1].tensors["x"], protocol=5)
    assert len(pickled) < len(as_torch_pickles_it) / 3  # not the whole storage
    restored = pickle.loads(pickled)
    assert_same(restored, chunks[1])
    restored.tensors["x"].zero_()  # owned and writable: the original is untouched
    assert torch.equal(chunks[1].tensors["x"], batch.tensors["x"][10:20])


def test_a_pickled_batch_keeps_shapes_of_empty_and_multi_dim_tensors():
    batch = Batch(tensors={"a": torch.zeros(0, 3), "b": torch.ones(0, 2, 2).transpose(1, 2)})
    assert_same(pickle.loads(pickle.dumps(batch)), batch)
    cube = Batch(tensors={"c": torch.arange(24.0).reshape(2, 3, 4).transpose(1, 2)})
    assert_same(pickle.loads(pickle.dumps(cube, protocol=5)), cube)


@pytest.mark.parametrize("dtype", [torch.long, torch.float32, torch.bfloat16, torch.bool])
@pytest.mark.parametrize("protocol", [4, 5])
def test_zero_width_tensors_cross_every_pickle_protocol(dtype, protocol):
    """A 0-column response (a request Ray carries to the workers) once failed to unpickle
    with protocol 5: the empty byte array's stride is 0 and torch refused to view it."""
    batch = Batch(
        tensors={
            "responses": torch.zeros(2, 0, dtype=dtype),
            "prompts": torch.ones(2, 1, dtype=dtype),
        }
    )
    assert_same(pickle.loads(pickle.dumps(batch, protocol=protocol)), batch)
    no_rows = Batch(tensors={"responses": torch.zeros(0, 3, dtype=dtype)})
    assert_same(pickle.loads(pickle.dumps(no_rows, protocol=protocol)), no_rows)


def test_split_pads_small_batch_with_first_rows():
    b = make_batch(1)
    chunks, pad_count = b.split(2)
    assert pad_count == 1
    assert_same(chunks[1], b)
    chunks, pad_count = make_batch(2).split(5)
    assert pad_count == 3
    assert [c["ground_truth"] for c in chunks] == [["gt0"], ["gt1"], ["gt0"], ["gt1"], ["gt0"]]


def test_split_empty_batch_gives_empty_chunks():
    chunks, pad_count = make_batch(0).split(3)
    assert pad_count == 0 and [len(c) for c in chunks] == [0, 0, 0]
    assert_same(Batch.collect(chunks, 0), make_batch(0))
    chunks, pad_count = Batch(meta={"step": 1}).split(2)
    assert pad_count == 0 and [c.meta for c in chunks] == [{"step": 1}] * 2


def test_split_collect_errors():
    b = make_batch(3)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="n_chunks must be a positive int"):
            b.split(bad)
    chunks, _ = b.split(2)
    with pytest.raises(ValueError, match=r"pad_count must be in \[0, 4\], got 5"):
        Batch.collect(chunks, 5)


def test_split_collect_random_property():
    """Random sizes, chunk counts and a simulated per-worker computation."""
    rng = random.Random(1234)
    for _ in range(200):
        size, n_chunks = rng.randint(0, 40), rng.randint(1, 9)
        seq = rng.randint(1, 4)
        b = Batch(
            tensors={
                "input_ids": torch.randint(0, 100, (size, seq)),
                "mask": torch.rand(size, seq) > 0.5,
            },
            non_tensors={"gt": [rng.choice(["a", None, 1, 2.5, True]) for _ in range(size)]},
            meta={"step": rng.randint(0, 9)},
        )
        chunks, pad_count = b.split(n_chunks)
        assert len(chunks) == n_chunks and 0 <= pad_count < n_chunks
        assert len({len(c) for c in chunks}) == 1
        # Workers add a result column; collect must keep rows aligned with the input.
        results = [c.union(Batch(tensors={"out": c["input_ids"].sum(dim=1)})) for c in chunks]
        out = Batch.collect(results, pad_count)
        assert_same(out.select(tensor_keys=["input_ids", "mask"]), b)
        assert torch.equal(out["out"], b["input_ids"].sum(dim=1))


def test_chunk():
    b = make_batch(7)
    parts = list(b.chunk(3))
    assert [len(p) for p in parts] == [3, 3, 1]
    assert [p["idx"] for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]
    assert_same(Batch.concat(parts), b)
    assert [len(p) for p in b.chunk(7)] == [7]
    assert [len(p) for p in b.chunk(100)] == [7]
    assert list(make_batch(0).chunk(2)) == []
    with pytest.raises(ValueError, match="max_rows must be a positive int"):
        list(b.chunk(0))


def test_to_device():
    b = make_batch(2)
    moved = b.to("cpu")
    assert moved is not b
    assert_same(moved, b)
    assert moved.to(torch.device("meta"))["scores"].device.type == "meta"
