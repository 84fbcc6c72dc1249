"""The long-term store (memory/): real FAISS, real SQLite, real files under tmp_path, the real embedder.

Stated int8 tolerance: every dequantized element is within scale / 2 of the original, where scale is the
largest magnitude of its key channel (over the segment's tokens) or of its value token (over head_dim),
divided by 127; so within 1/254 of that maximum."""

from __future__ import annotations

import gc
import shutil
import socket
import sqlite3

import numpy as np
import pytest
import torch

from agent.packed import WidenedLinear, packable
from memory.archive import DB_NAME, INDEX_NAME, KV_DIR, Archive, ArchiveConfig
from memory.embedder import DTYPES, WIDENED, Embedder, EmbedderConfig, embed_mode, native_bfloat16_cpu
from memory.files import ArchiveError
from memory.index import KINDS, IndexConfig, VectorIndex
from memory.segment import Segment

LAYERS, HEADS, DIM = 30, 3, 64  # SmolLM2-135M's KV shape


@pytest.fixture(scope="session")
def embedder():
    """Loaded (and used once) with every outgoing connection refused and recorded: a library that
    swallowed the refusal and fell back to local files would still fail here."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access during embedder load")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", refuse)
        patch.setattr(socket.socket, "connect_ex", refuse)
        patch.setattr(socket, "create_connection", refuse)
        model = Embedder()
        model.embed("warm up")
    assert attempts == []
    return model


def segment(seed: int = 0, tokens: int = 8, layers: int = 2, user: str = "alice", session: str = "s1",
            turn: int = 0, topic: int = 0, text: str = "hello", kind: str = "turn",
            dtype: torch.dtype = torch.float32) -> Segment:
    """Random KV with outlier key channels (as real keys have: scales 0.5..8 across channels)."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.5, 8.0, DIM)
    keys = (torch.randn(layers, HEADS, tokens, DIM, generator=generator) * scales).to(dtype)
    values = torch.randn(layers, HEADS, tokens, DIM, generator=generator).to(dtype)
    return Segment(user, session, list(range(seed, seed + tokens)), text, turn, "user", topic,
                   torch.arange(tokens) + 100 * seed, keys, values, torch.rand(tokens, generator=generator),
                   torch.rand(tokens, generator=generator), torch.arange(tokens) + 1000 * seed, kind=kind)


def unit(rng: np.random.Generator, count: int, dim: int = 384) -> np.ndarray:
    vectors = rng.standard_normal((count, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def near(rng: np.random.Generator, vector: np.ndarray, noise: float = 0.01) -> np.ndarray:
    """A unit vector at cosine ~0.98 from `vector` (noise per coordinate; 384 coordinates)."""
    moved = vector + noise * rng.standard_normal(vector.shape).astype(np.float32)
    return moved / np.linalg.norm(moved)


def same_segment(got: Segment, want: Segment) -> bool:
    return (all(torch.equal(a, b) for a, b in zip((got.keys, got.values), (want.keys, want.values)))
            and got.tokens == want.tokens and torch.equal(got.positions, want.positions)
            and torch.equal(got.importance, want.importance) and torch.equal(got.surprisal, want.surprisal)
            and torch.equal(got.serials, want.serials)
            and (got.text, got.turn, got.topic, got.kind, got.role, got.user_id, got.session_id)
            == (want.text, want.turn, want.topic, want.kind, want.role, want.user_id, want.session_id))


def payload_bytes(seg: Segment) -> int:
    return sum(t.numel() * t.element_size() for t in (seg.keys, seg.values))


# --- embedder ---------------------------------------------------------------------------------------

def test_embedder_unit_vectors_meaningful_and_cached(embedder):
    texts = ["Where is my parcel?", "My package has not arrived yet.", "I like green tea in the morning."]
    vectors = embedder.embed(texts)
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.2  # the model is real, not a stub
    misses = embedder.cache_info().misses
    again = embedder.embed([texts[1], texts[1]])
    assert embedder.cache_info().misses == misses  # embedded once, served from the cache after
    assert np.array_equal(again[0], vectors[1]) and np.array_equal(again[1], vectors[1])



def test_embedder_bfloat16_agrees_with_float32(embedder):
    """`auto` may pick bfloat16 (fast where the CPU multiplies it natively): its embeddings must rank as
    float32's do, or a threshold tuned in one precision would mean something else in the other."""
    texts = ["Where is my parcel?", "My package has not arrived yet.", "I like green tea in the morning.",
             "Can I change the delivery address to Flat 14?"]
    wide = Embedder(EmbedderConfig(dtype="float32", cache_size=0)).embed(texts)
    narrow = Embedder(EmbedderConfig(dtype="bfloat16", cache_size=0)).embed(texts)
    assert narrow.dtype == np.float32 and np.allclose(np.linalg.norm(narrow, axis=1), 1, atol=1e-5)
    assert (wide * narrow).sum(1).min() > 0.999
    assert np.abs(wide @ wide.T - narrow @ narrow.T).max() < 0.01
    rounded = Embedder(EmbedderConfig(dtype=WIDENED, cache_size=0)).embed(texts)  # float32 arithmetic
    assert 0.99995 < (wide * rounded).sum(1).min() < 1 - 1e-8  # closer still, and not float32's own vectors
    assert np.abs(wide @ wide.T - rounded @ rounded.T).max() < 0.002
    auto = embed_mode("auto", torch.device("cpu"))
    assert embedder.mode == auto == ("bfloat16" if native_bfloat16_cpu() else WIDENED)
    assert embedder.dtype == DTYPES[embedder.mode]
    with pytest.raises(ValueError, match="unknown embedder dtype 'int8'"):
        EmbedderConfig(dtype="int8")

def test_embedder_pools_as_sentence_transformers_encode_does(embedder):
    """The embedder's own pass (transformer, mean over the mask, unit length; token lengths padded to a multiple
    of PAD_TO) gives what sentence-transformers' encode gives, alone or in a batch of other lengths."""
    texts = ["Hi", "Flat 14, 37 Larch Close, please: the courier keeps going to number 73 instead of mine.",
             "Can I move the booking FB-22817 to Sunday?"]
    exact = Embedder(EmbedderConfig(dtype="float32", cache_size=0))
    assert exact._direct
    encoded = exact.model.encode(texts, convert_to_numpy=True).astype(np.float32)
    encoded /= np.linalg.norm(encoded, axis=1, keepdims=True)
    batch = exact.embed(texts)
    alone = np.stack([exact.embed(text)[0] for text in texts])
    assert (batch * encoded).sum(1).min() > 0.99999 and (alone * batch).sum(1).min() > 0.99999


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", WIDENED])
def test_embedder_lean_pass_equals_transformers_forward(dtype):
    """The lean encoder pass computes BertModel's products in its order: the same hidden states, padded
    batch or not, in each precision (so nothing tuned on vectors of one path means else on the other); with
    bfloat16 weights, those of BertModel with its linear weights so rounded."""
    embedder = Embedder(EmbedderConfig(dtype=dtype, cache_size=0))
    assert embedder._lean is not None and embedder.mode == dtype
    linears = [linear for layer in embedder._lean.layers for linear in layer if hasattr(linear, "packed")]
    assert len(linears) == 4 * len(embedder._lean.layers)
    bf16_packable = packable(torch.zeros(1, 1, dtype=torch.bfloat16))  # not on an AVX2-only CPU (agent/packed.py)
    if dtype == WIDENED:  # the path under test
        assert all(isinstance(linear, WidenedLinear) for linear in linears)
        for module in embedder.model[0].auto_model.encoder.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.data = module.weight.data.to(torch.bfloat16).float()
    else:
        assert {linear.packed is not None for linear in linears} == {dtype == "bfloat16" and bf16_packable}
    texts = ["Hi", "Flat 14, 37 Larch Close, please: the courier keeps going to number 73 instead of mine.",
             "Can I move the booking FB-22817 to Sunday?"]
    for batch in ([texts[1]], texts):
        tokens = embedder.model.tokenizer(batch, padding=True, pad_to_multiple_of=16, return_tensors="pt")
        with torch.inference_mode():
            reference = embedder.model[0].auto_model(**tokens).last_hidden_state
            lean = embedder._lean(tokens)
        real = tokens["attention_mask"].bool()  # padded rows are never pooled
        assert lean.dtype == reference.dtype and torch.allclose(lean[real].float(), reference[real].float(), atol=1e-5)


# --- index --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_index_finds_planted_neighbour(kind):
    rng = np.random.default_rng(1)
    index = VectorIndex(IndexConfig(kind=kind))
    crowd = unit(rng, 1000)
    index.add(range(1000), crowd, "alice", "s1")
    planted = unit(rng, 1)[0]
    index.add([5000], planted, "alice", "s1")
    index.add([6000], planted, "bob", "s1")  # the exact vector, another user's
    found = index.search(near(rng, planted), "alice", "s1", k=5)
    assert found[0][0] == 5000 and found[0][1] > 0.9
    assert all(segment_id < 6000 for segment_id, _ in found)
    assert [i for i, _ in index.search(near(rng, planted), "alice", "s1", k=5, threshold=0.6)] == [5000]


@pytest.mark.parametrize("kind", KINDS)
def test_index_scopes_never_mix(kind, tmp_path):
    rng = np.random.default_rng(2)
    index = VectorIndex(IndexConfig(kind=kind))
    shared = unit(rng, 20)  # identical memories for every scope: only the scope can tell them apart
    scopes = {("alice", "s1"): 0, ("alice", "s2"): 100, ("bob", "s1"): 200}
    for (user, session), base in scopes.items():
        index.add(range(base, base + 20), shared, user, session)
    index.save(tmp_path / "index.faiss")
    loaded, _ = VectorIndex.load(tmp_path / "index.faiss")
    for candidate in (index, loaded):
        for (user, session), base in scopes.items():
            found = candidate.search(shared[3], user, session, k=50)
            assert len(found) == 20 and {i for i, _ in found} == set(range(base, base + 20))
        assert candidate.search(shared[3], "carol", "s1") == []
        assert candidate.search(shared[3], "bob", "s2") == []
    with pytest.raises(ValueError):
        index.search(shared[3], "", "s1")


@pytest.mark.parametrize("kind", KINDS)
def test_index_removal_persists(kind, tmp_path):
    rng = np.random.default_rng(3)
    vectors = unit(rng, 200)
    index = VectorIndex(IndexConfig(kind=kind))
    index.add(range(200), vectors, "alice", "s1")
    gone = set(range(0, 200, 3))  # a third: HNSW compacts its graph past a quarter
    assert index.remove(gone) == len(gone) and len(index) == 200 - len(gone)
    index.remove([10_000])  # unknown ids are ignored
    index.save(tmp_path / "index.faiss", stamp=7)
    loaded, stamp = VectorIndex.load(tmp_path / "index.faiss")
    assert stamp == 7 and loaded.ids() == set(range(200)) - gone
    for candidate in (index, loaded):
        for probe in (0, 3, 4):
            found = [i for i, _ in candidate.search(vectors[probe], "alice", "s1", k=10)]
            assert not gone & set(found) and len(found) == 10
            assert probe in gone or found[0] == probe
    with pytest.raises(ValueError):
        index.add([1], vectors[1], "alice", "s1")  # still held
    with pytest.raises(ValueError):
        index.add([500], vectors[1] * 2, "alice", "s1")  # not unit length


# --- KV round trips, spill, disk cap ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_kv_round_trip_is_exact(dtype):
    rng = np.random.default_rng(4)
    original = segment(seed=4, tokens=40, layers=LAYERS, dtype=dtype)
    with Archive.create() as archive:
        segment_id = archive.add(original, unit(rng, 1)[0])
        got = archive.get(segment_id)
        assert got.id == segment_id and got.keys[0].dtype == dtype and same_segment(got, original)
        assert archive.nbytes() == payload_bytes(original)
        got.keys[0].add_(1.0)  # the caller may modify what it gets (e.g. re-rotate) ...
        assert same_segment(archive.get(segment_id), original)  # ... without touching the archive
        assert archive.get(segment_id, dtype=torch.float16).values[3].dtype == torch.float16


def test_int8_kv_within_stated_tolerance():
    rng = np.random.default_rng(5)
    original = segment(seed=5, tokens=40, layers=LAYERS)
    with Archive.create(config=ArchiveConfig(kv_codec="int8")) as archive:
        got = archive.get(archive.add(original, unit(rng, 1)[0]))
        for want, have in zip(original.keys, got.keys):
            bound = want.abs().amax(dim=1, keepdim=True) / 254  # per key channel, over tokens
            assert have.dtype == torch.float32 and bool(((have - want).abs() <= bound * 1.0001 + 1e-7).all())
        for want, have in zip(original.values, got.values):
            bound = want.abs().amax(dim=2, keepdim=True) / 254  # per value token, over channels
            assert bool(((have - want).abs() <= bound * 1.0001 + 1e-7).all())
        error = torch.linalg.norm(got.keys - original.keys) / torch.linalg.norm(original.keys)
        assert error < 0.01
        assert archive.nbytes() < 0.3 * payload_bytes(original)
        assert got.tokens == original.tokens and torch.equal(got.positions, original.positions)


def test_spill_past_memory_cap_and_back(tmp_path):
    rng = np.random.default_rng(6)
    originals = [segment(seed=i, tokens=16, turn=i) for i in range(8)]
    cap = int(payload_bytes(originals[0]) * 2.5)
    with Archive.create(tmp_path / "session", ArchiveConfig(memory_cap_bytes=cap)) as archive:
        ids = []
        for original in originals:
            ids.append(archive.add(original, unit(rng, 1)[0]))
            assert archive.nbytes() <= cap
        assert archive.nbytes() == 2 * payload_bytes(originals[0])  # the two newest stay in memory
        spilled = sorted(p.name for p in (tmp_path / "session" / KV_DIR).iterdir())
        assert spilled == sorted(f"{i}.kv" for i in ids[:6])
        held = archive.nbytes()
        assert all(same_segment(archive.get(i), original) for i, original in zip(ids, originals))
        assert archive.nbytes() == held  # reading a spilled segment does not pull it back into memory


@pytest.mark.parametrize("kv_codec", ["float", "int8"])
def test_spans_read_at_once_equal_each_segment_read_alone(kv_codec, tmp_path):
    """`Archive.spans` (one query for many segments, what a recall reads) gives, in the order asked, what
    `get(id).to_span()` gives for each: every metadata column and the KV, from memory and from disk, for
    segments of both roles, several turns and topics, and bfloat16 KV beside float32; an unknown id is a
    KeyError."""
    rng = np.random.default_rng(9)
    originals = [segment(seed=i, tokens=3 + 2 * i, turn=10 - i, topic=i % 3, text=f"turn {i}",
                         dtype=torch.bfloat16 if i % 4 == 3 else torch.float32) for i in range(7)]
    originals[2].role = "assistant"
    cap = int(payload_bytes(originals[-1]) * (2.5 if kv_codec == "float" else 0.7))  # int8: about a quarter the bytes
    with Archive.create(tmp_path / "session", ArchiveConfig(memory_cap_bytes=cap, kv_codec=kv_codec)) as archive:
        ids = [archive.add(original, unit(rng, 1)[0]) for original in originals]
        assert any((tmp_path / "session" / KV_DIR).iterdir()) and archive.nbytes() > 0  # on disk and in memory
        asked = [ids[5], ids[0], ids[2], ids[6], ids[3]]
        spans = archive.spans(asked)
        assert len(spans) == len(asked)
        for span, segment_id in zip(spans, asked):
            alone = archive.get(segment_id).to_span()
            for name in ("token", "segment", "turn", "role", "position", "pinned", "importance", "surprisal",
                         "serial", "recalled_at"):
                assert torch.equal(getattr(span.meta, name), getattr(alone.meta, name)), name
            assert torch.equal(span.keys, alone.keys) and torch.equal(span.values, alone.values)
        with pytest.raises(KeyError):
            archive.spans([ids[1], 12345])


def test_disk_cap_evicts_oldest_spilled(tmp_path):
    rng = np.random.default_rng(7)
    originals = [segment(seed=i, tokens=16, turn=i, text=f"turn {i}") for i in range(8)]
    vectors = unit(rng, 8)
    size = payload_bytes(originals[0])
    config = ArchiveConfig(memory_cap_bytes=size, disk_cap_bytes=int(size * 3.5))
    with Archive.create(tmp_path / "session", config) as archive:
        ids = [archive.add(original, vector) for original, vector in zip(originals, vectors)]
        # one in memory, three files fit under the cap: the four oldest are gone everywhere
        evicted, kept = ids[:4], ids[4:]
        assert len(archive) == 4 and all(i not in archive for i in evicted)
        for i in evicted:
            with pytest.raises(KeyError):
                archive.get(i)
        assert [r.id for r in archive.segments_for("alice", "s1")] == kept
        assert {i for i, _ in archive.search(vectors[0], "alice", "s1", k=8)} == set(kept)
        before = archive.disk_bytes()
        archive.save()  # evicted files are deleted once their rows' deletion is committed
        assert archive.disk_bytes() < before
        files = {p.name for p in (tmp_path / "session" / KV_DIR).iterdir()}
        assert files == {f"{i}.kv" for i in kept}  # save() also wrote the one still in memory
        assert all(same_segment(archive.get(i), originals[i - 1]) for i in kept)


# --- reopening, corruption, versions -------------------------------------------------------------------

@pytest.mark.parametrize("kind,kv_codec", [("flat", "float"), ("hnsw", "int8"), ("lsh", "float")])
def test_reopen_restores_everything(kind, kv_codec, tmp_path):
    rng = np.random.default_rng(8)
    directory = tmp_path / "session"
    originals = [segment(seed=i, tokens=12, turn=i, topic=i // 2, user=("alice", "bob")[i % 2],
                         text=f"turn {i}") for i in range(7)]
    vectors = unit(rng, 7)
    config = ArchiveConfig(index=IndexConfig(kind=kind), kv_codec=kv_codec,
                           memory_cap_bytes=3 * payload_bytes(originals[0]))
    archive = Archive.create(directory, config)
    ids = [archive.add(original, vector) for original, vector in zip(originals, vectors)]
    archive.remove(ids[2])
    before = {i: archive.get(i) for i in ids if i != ids[2]}
    searches = {user: archive.search(vectors[0], user, "s1", k=7) for user in ("alice", "bob")}
    lookups = {user: archive.segments_for(user, "s1") for user in ("alice", "bob")}
    archive.close()

    with Archive.open(directory) as reopened:
        assert reopened.config == config and len(reopened) == 6 and ids[2] not in reopened
        assert reopened.nbytes() == 0  # KV comes back from its files, on demand
        assert all(same_segment(reopened.get(i), seg) for i, seg in before.items())
        assert {u: reopened.search(vectors[0], u, "s1", k=7) for u in searches} == searches
        assert {u: reopened.segments_for(u, "s1") for u in lookups} == lookups
        assert reopened.add(originals[2], vectors[2]) == ids[-1] + 1  # ids are never reused


def test_stale_index_is_rebuilt_from_the_database(tmp_path):
    """A crash between the index write and the commit leaves an index of another generation."""
    rng = np.random.default_rng(9)
    directory = tmp_path / "session"
    vectors = unit(rng, 4)
    with Archive.create(directory) as archive:
        first = archive.add(segment(seed=0), vectors[0])
        archive.save()
        shutil.copy(directory / INDEX_NAME, tmp_path / "old-index")
        second = archive.add(segment(seed=1), vectors[1])
    shutil.copy(tmp_path / "old-index", directory / INDEX_NAME)
    with Archive.open(directory) as reopened:
        assert reopened.search(vectors[1], "alice", "s1", k=1)[0][0] == second
        assert {i for i, _ in reopened.search(vectors[0], "alice", "s1", k=5)} == {first, second}


def test_work_after_the_last_save_is_dropped_cleanly(tmp_path):
    """An archive abandoned without save() (a crash): its uncommitted rows roll back, and the KV files
    they spilled are deleted as strays on reopen."""
    rng = np.random.default_rng(12)
    directory = tmp_path / "session"
    first = segment(seed=0)
    archive = Archive.create(directory, ArchiveConfig(memory_cap_bytes=1))
    kept = archive.add(first, unit(rng, 1)[0])
    archive.save()
    for seed in range(1, 4):
        archive.add(segment(seed=seed), unit(rng, 1)[0])
    assert len(list((directory / KV_DIR).iterdir())) == 4
    del archive  # the connection closes without a commit
    gc.collect()
    with Archive.open(directory) as reopened:
        assert len(reopened) == 1 and same_segment(reopened.get(kept), first)
        assert [p.name for p in (directory / KV_DIR).iterdir()] == [f"{kept}.kv"]


def saved_session(tmp_path) -> tuple:
    directory = tmp_path / "session"
    rng = np.random.default_rng(10)
    with Archive.create(directory, ArchiveConfig(memory_cap_bytes=1)) as archive:
        ids = [archive.add(segment(seed=i, tokens=16, turn=i), unit(rng, 1)[0]) for i in range(3)]
    return directory, ids


def overwrite(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def truncate(path, fraction: float = 0.5) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(int(handle.seek(0, 2) * fraction))


CORRUPTIONS = {
    "db garbage": (DB_NAME, lambda p: p.write_bytes(b"this is not a database" * 200)),
    "db truncated": (DB_NAME, lambda p: truncate(p, 0.4)),
    "index byte flipped": (INDEX_NAME, lambda p: overwrite(p, p.stat().st_size - 100, b"\xff\x00\xff")),
    "index truncated": (INDEX_NAME, truncate),
    "index missing": (INDEX_NAME, lambda p: p.unlink()),
    "kv truncated": (f"{KV_DIR}/2.kv", truncate),
    "kv missing": (f"{KV_DIR}/2.kv", lambda p: p.unlink()),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_corrupt_file_is_named_on_open(name, tmp_path):
    directory, _ = saved_session(tmp_path)
    relative, damage = CORRUPTIONS[name]
    damage(directory / relative)
    with pytest.raises(ArchiveError) as raised:
        Archive.open(directory)
    message = str(raised.value)
    assert relative.split("/")[-1] in message and "\n" not in message
    assert raised.value.path == directory / relative


def test_corrupt_kv_contents_are_named_on_get(tmp_path):
    directory, ids = saved_session(tmp_path)
    path = directory / KV_DIR / f"{ids[1]}.kv"
    overwrite(path, path.stat().st_size // 2, b"\x00\x01\x02\x03")  # same size: only the CRC can tell
    with Archive.open(directory) as archive:
        archive.get(ids[0])
        with pytest.raises(ArchiveError, match=f"{ids[1]}.kv"):
            archive.get(ids[1])


def test_other_format_versions_are_refused(tmp_path):
    directory, _ = saved_session(tmp_path)
    db = sqlite3.connect(directory / DB_NAME)
    db.execute("UPDATE meta SET value = '1' WHERE key = 'format_version'")
    db.commit()
    db.close()
    with pytest.raises(ArchiveError, match=r"archive\.sqlite: archive format version 1; this code reads version 2$"):
        Archive.open(directory)


def test_index_file_of_another_version_is_refused(tmp_path):
    VectorIndex().save(tmp_path / "index.faiss")
    data = (tmp_path / "index.faiss").read_bytes()
    (tmp_path / "index.faiss").write_bytes(data.replace(b'"version": 1', b'"version": 9', 1))
    with pytest.raises(ArchiveError, match="index format version 9"):
        VectorIndex.load(tmp_path / "index.faiss")


def test_create_refuses_an_existing_archive(tmp_path):
    directory, _ = saved_session(tmp_path)
    with pytest.raises(ArchiveError, match="already exists"):
        Archive.create(directory)


# --- metadata lookups and scoped search through the archive ---------------------------------------------

def test_metadata_lookups(tmp_path):
    rng = np.random.default_rng(11)
    texts = ["I live in Zürich.", "The order #12 was late.", "ZÜRICH is expensive.", "Summary: order issues."]
    with Archive.create(tmp_path / "session") as archive:
        ids = [archive.add(segment(seed=i, turn=i, topic=i // 2, text=text,
                                   kind="summary" if i == 3 else "turn"), unit(rng, 1)[0])
               for i, text in enumerate(texts)]
        archive.add(segment(seed=9, user="bob", text="I live in Zürich too."), unit(rng, 1)[0])
        found = lambda **query: [r.id for r in archive.segments_for("alice", "s1", **query)]  # noqa: E731
        assert found(contains="zürich") == [ids[0], ids[2]]  # Unicode case-insensitive, alice's only
        assert found(topic=1) == [ids[2], ids[3]]
        assert found(turns=range(1, 3)) == [ids[1], ids[2]]
        assert found(kind="summary") == [ids[3]]
        assert found(topic=0, contains="order") == [ids[1]]
        assert archive.segments_for("alice", "s2") == []


def test_archive_search_is_scoped_by_user_and_session(embedder):
    memories = {("alice", "s1"): "My dog is called Rex.", ("bob", "s1"): "My dog is called Bruno.",
                ("alice", "s2"): "My dog is called Fido."}
    vectors = dict(zip([*memories.values(), "I paid by card.", "What is my dog's name?"],
                       embedder.embed([*memories.values(), "I paid by card.", "What is my dog's name?"])))
    with Archive.create() as archive:
        owner = {}
        for (user, session), text in memories.items():
            segment_id = archive.add(segment(user=user, session=session, text=text), vectors[text])
            owner[segment_id] = (user, session)
            archive.add(segment(user=user, session=session, text="I paid by card."), vectors["I paid by card."])
        query = vectors["What is my dog's name?"]
        for scope, text in memories.items():
            found = archive.search(query, *scope, k=5)
            assert len(found) == 2 and archive.get(found[0][0]).text == text
            assert all(owner.get(i, scope) == scope for i, _ in found)
            assert all((archive.record(i).user_id, archive.record(i).session_id) == scope for i, _ in found)
        assert archive.search(query, "carol", "s1") == []
        assert [archive.get(i).text for i, _ in archive.search(query, "bob", "s1", threshold=0.5)] == [memories[("bob", "s1")]]


def test_segment_rejects_misaligned_tensors():
    good = segment()
    with pytest.raises(ValueError, match="keys"):
        Segment(**{**vars(good), "keys": good.keys[:, :, :-1]})
    with pytest.raises(ValueError, match="positions"):
        Segment(**{**vars(good), "positions": good.positions[:-1]})
    with pytest.raises(ValueError, match="user_id"):
        Segment(**{**vars(good), "user_id": ""})
