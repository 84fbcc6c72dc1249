"""Sessions on disk (agent/session.py): a saved conversation continues token for token, survives a process
killed mid-save, and a damaged or foreign file is one clear line. Also: a reply stopped early leaves the
cache matching the history, and an Agent refuses a second thread. Real components throughout: a tiny
random Llama with the embedded tokenizer (or the embedded model), MiniLM, FAISS, SQLite, real files."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch

from agent import Agent, AgentConfig, SamplingConfig
from agent.agent import AgentBusyError
from agent.model import load_model
from agent.session import MANIFEST, SessionError, list_sessions
from memory.files import ArchiveError
from memory.profile import ProfileConfig
from memory.recall import MemoryConfig
from tests.helpers import teacher_force

ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}  # child processes of the tiny model: one thread is faster

TURNS = [("Hi, I'm Dana Whitfield and my order number is 448213.", "Thanks Dana, I have order 448213 here."),
         ("I live at 14 Elm Road, Hartford, HF4 7DR.", "Noted: 14 Elm Road, HF4 7DR."),
         ("Please never phone me, email only.", "Understood, email only."),
         ("Can you check when my refund for the kettle arrives?", "The refund for the kettle takes 5 days."),
         ("Sorry, it's 15 Elm Road, not 14 Elm Road.", "Updated to 15 Elm Road."),
         ("Also, do you sell descaler tablets?", "Yes, we sell descaler tablets."),
         ("How much is delivery to Hartford?", "Delivery is 3.99 pounds.")]


def palace_config(model: str, budget: int = 96, tokens: int = 8) -> AgentConfig:
    """What `palace chat` runs: topics, memory, graph and notes, at a budget small enough to evict."""
    return AgentConfig(model=model, budget_tokens=budget, topics=True, memory=MemoryConfig(), graph=True,
                       profile=ProfileConfig(), sampling=SamplingConfig(max_new_tokens=tokens))


@pytest.fixture(scope="module")
def tiny_loaded(tiny_dir):
    return load_model(tiny_dir, device="cpu")


def conversed(loaded, config: AgentConfig, turns=TURNS) -> Agent:
    agent = Agent(loaded, config)
    for user, reply in turns:
        teacher_force(agent, user, reply)
    return agent


def test_resumed_session_continues_token_for_token(tiny_loaded, tiny_dir, tmp_path):
    agent = conversed(tiny_loaded, palace_config(tiny_dir, budget=160))
    agent.chat("What did I say my order number was?")
    assert len(agent.memory.archive) > 0 and agent.graph.superseded()  # there is an archive and a correction
    agent.save(tmp_path / "s")
    shutil.copytree(tmp_path / "s", tmp_path / "copy")  # the saved session, as a later process finds it
    resumed = Agent.load(tmp_path / "copy", loaded=tiny_loaded)
    assert resumed.turn_index == agent.turn_index and resumed.notes == agent.notes
    assert [t.reply for t in resumed.history] == [t.reply for t in agent.history]
    recalled = []
    for question in ("Is order 448213 dispatched yet?", "And where is it going?", "Is the refund for the kettle done?"):
        assert resumed.chat(question) == agent.chat(question)
        assert [r.as_dict() for r in resumed.memory.last] == [r.as_dict() for r in agent.memory.last]
        recalled += agent.memory.last
        assert torch.equal(resumed.store.meta.token, agent.store.meta.token)
        assert torch.equal(resumed.store.meta.serial, agent.store.meta.serial)
        assert torch.equal(resumed.store.next_logits, agent.store.next_logits)
    assert recalled, "the resumed turns should re-inject archived KV"
    assert resumed.stats()["graph"] == agent.stats()["graph"] and resumed.tracker.state() == agent.tracker.state()


def test_resumed_embedded_session_replies_as_the_uninterrupted_agent(embedded, tmp_path):
    config = palace_config("embedded", budget=160, tokens=12)
    agent = conversed(embedded, config, TURNS[:4])
    agent.save(tmp_path / "s")
    shutil.copytree(tmp_path / "s", tmp_path / "copy")
    resumed = Agent.load(tmp_path / "copy", loaded=embedded)
    assert resumed.chat("What is my order number?") == agent.chat("What is my order number?")


def test_first_save_moves_the_archive_into_the_session_and_later_saves_add_to_it(tiny_loaded, tiny_dir, tmp_path):
    agent = conversed(tiny_loaded, palace_config(tiny_dir), TURNS[:4])
    assert agent.memory.archive.directory is None  # in memory until saved
    before = len(agent.memory.archive)
    agent.save(tmp_path / "s")
    assert agent.memory.archive.directory == tmp_path / "s" / "archive-1" and len(agent.memory.archive) == before
    teacher_force(agent, *TURNS[4])
    agent.save()
    names = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert names == ["archive-1", "lock", "session.json", "state-2.pt"]  # the previous state file is gone
    assert json.loads((tmp_path / "s" / MANIFEST).read_text())["turns"] == 5


def test_a_session_is_held_by_one_agent_and_another_conversation_is_not_overwritten(tiny_loaded, tiny_dir, tmp_path):
    agent = conversed(tiny_loaded, palace_config(tiny_dir), TURNS[:2])
    agent.save(tmp_path / "s")
    with pytest.raises(SessionError, match="in use by another agent"):
        Agent.load(tmp_path / "s", loaded=tiny_loaded)
    other = conversed(tiny_loaded, palace_config(tiny_dir), TURNS[2:3])
    other.save(tmp_path / "t")
    other.close()
    agent.reset()  # a new conversation may not silently replace the saved one...
    with pytest.raises(SessionError, match="another conversation"):
        agent.save(tmp_path / "t")
    agent.save(overwrite=True)  # ...unless asked to
    assert json.loads((tmp_path / "s" / MANIFEST).read_text())["turns"] == 0


def test_damaged_and_foreign_sessions_are_refused_in_one_line_naming_the_file(tiny_loaded, tiny_dir, embedded, tmp_path):
    agent = conversed(tiny_loaded, palace_config(tiny_dir), TURNS[:5])
    agent.save(tmp_path / "good")
    agent.close()
    for name in ("manifest", "state", "truncated", "sqlite", "faiss", "version", "model"):
        shutil.copytree(tmp_path / "good", tmp_path / name)
    manifest = json.loads((tmp_path / "good" / MANIFEST).read_text())
    (tmp_path / "manifest" / MANIFEST).write_text("{not json")
    state = tmp_path / "state" / manifest["state"]
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    truncated = tmp_path / "truncated" / manifest["state"]
    truncated.write_bytes(truncated.read_bytes()[:1000])
    (tmp_path / "sqlite" / manifest["archive"] / "archive.sqlite").write_bytes(b"SQLite format 3\x00" + b"\x00" * 600)
    faiss_file = tmp_path / "faiss" / manifest["archive"] / "index.faiss"
    faiss_file.write_bytes(faiss_file.read_bytes()[:-7])
    (tmp_path / "version" / MANIFEST).write_text(json.dumps({**manifest, "format_version": 99}))
    expected = {"manifest": (MANIFEST, "not a readable session manifest"), "state": (manifest["state"], "corrupt"),
                "truncated": (manifest["state"], "truncated"), "sqlite": ("archive.sqlite", "not a readable archive"),
                "faiss": ("index.faiss", ""), "version": (MANIFEST, "format version 99"),
                "model": (MANIFEST, "saved for another model")}
    for name, (file, words) in expected.items():
        with pytest.raises(ArchiveError) as caught:
            Agent.load(tmp_path / name, loaded=embedded if name == "model" else tiny_loaded)
        message = str(caught.value)
        assert "\n" not in message and file in message and words in message, (name, message)
    assert Agent.load(tmp_path / "good", loaded=tiny_loaded).turn_index == 5  # the others stay usable
    listed = {info.path.name: info for info in list_sessions(tmp_path)}
    assert listed["good"].turns == 5 and listed["manifest"].problem and listed["version"].problem


def test_a_quantized_cache_saved_in_an_older_layout_is_refused_naming_the_state_file(tiny_loaded, tiny_dir, tmp_path):
    """Sessions saved before key rows owed their shifts (layout 1) cannot be read back into this storage."""
    from cache.storage import StorageConfig

    config = dataclasses.replace(palace_config(tiny_dir), storage=StorageConfig("int8", residual=8, group=8))
    agent = conversed(tiny_loaded, config, TURNS[:3])
    agent.save(tmp_path / "old")
    agent.close()
    manifest = json.loads((tmp_path / "old" / MANIFEST).read_text())
    state_file = tmp_path / "old" / manifest["state"]
    state = torch.load(state_file, weights_only=True)
    resumed = Agent.load(tmp_path / "old", loaded=tiny_loaded)
    assert resumed.turn_index == 3
    resumed.close()
    for layer in state["store"]["layers"]:
        assert layer.pop("layout") == 2
    buffer = io.BytesIO()
    torch.save(state, buffer)
    state_file.write_bytes(buffer.getvalue())
    manifest.update(state_bytes=len(buffer.getvalue()), state_crc32=zlib.crc32(buffer.getvalue()))
    (tmp_path / "old" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SessionError) as caught:
        Agent.load(tmp_path / "old", loaded=tiny_loaded)
    message = str(caught.value)
    assert "\n" not in message and manifest["state"] in message and "layout 1" in message


KILLED_SAVER = textwrap.dedent("""
    import sys, time
    from agent import Agent, AgentConfig, SamplingConfig
    from agent.model import load_model
    from memory.profile import ProfileConfig
    from memory.recall import MemoryConfig
    from tests.helpers import teacher_force
    model_dir, session = sys.argv[1], sys.argv[2]
    loaded = load_model(model_dir, device="cpu")
    try:
        agent = Agent.load(session, loaded=loaded)
    except Exception:  # no session yet
        agent = Agent(loaded, AgentConfig(model=model_dir, budget_tokens=64, topics=True, memory=MemoryConfig(),
                                          graph=True, profile=ProfileConfig(), sampling=SamplingConfig(4)))
        agent.save(session)
    print("ready", agent.turn_index, flush=True)
    while True:
        n = agent.turn_index
        teacher_force(agent, f"Turn {n}: my order {10000 + n} to {n} Elm Road, please.", f"Noted order {10000 + n}.")
        print("save", n + 1, flush=True)
        agent.save()
        print("saved", n + 1, flush=True)
""")


def test_a_process_killed_at_random_points_of_its_saves_leaves_a_loadable_session(tiny_loaded, tiny_dir, tmp_path):
    session, rng, mid_save = tmp_path / "s", random.Random(7), 0
    root = Path(__file__).resolve().parents[1]
    for _ in range(6):
        child = subprocess.Popen([sys.executable, "-c", KILLED_SAVER, tiny_dir, str(session)], cwd=root, env=ONE_THREAD,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = [child.stdout.readline().split()]
        assert lines[0][:1] == ["ready"], child.stderr.read()
        duration = None  # aim at a save: time one, then kill the next at a random point of its length
        while duration is None or lines[-1][0] != "save":
            lines.append(child.stdout.readline().split())
            if lines[-1][0] == "save":
                started = time.perf_counter()
            elif lines[-1][0] == "saved" and len(lines) > 2:
                duration = time.perf_counter() - started
        time.sleep(rng.uniform(0.0, duration))
        child.send_signal(signal.SIGKILL)
        lines += [line.split() for line in child.stdout.read().splitlines()]
        child.wait()
        last_saved = max([int(line[1]) for line in lines if line[0] in ("ready", "saved")])
        mid_save += lines[-1][0] == "save"
        agent = Agent.load(session, loaded=tiny_loaded)  # every time, the newest finished save loads
        assert agent.turn_index in (last_saved, last_saved + 1), (agent.turn_index, lines[-3:])
        assert len(agent.history) == agent.turn_index and agent.store.length <= 64
        held = set(agent.store.meta.serial.tolist())
        archived = set(torch.cat([serials for _, serials in agent.memory.kept.values()]).tolist()) if agent.memory.kept else set()
        assert not held & archived  # nothing both live and archived: a crashed save's extra segments are gone
        agent.close()
    assert mid_save >= 3, f"only {mid_save} of 6 kills landed inside a save"


def test_a_reply_stopped_early_is_kept_and_the_cache_matches_the_history(tiny_loaded, tiny_dir):
    agent = Agent(tiny_loaded, AgentConfig(model=tiny_dir, policy="full", budget_tokens=None,
                                           sampling=SamplingConfig(max_new_tokens=40)))
    pieces = []
    for piece in agent.stream("Tell me a long story."):  # the caller stops reading after three pieces
        pieces.append(piece)
        if len(pieces) == 3:
            break
    shown = "".join(pieces)
    stopped = agent.history[-1]
    assert stopped.reply == shown
    fmt, meta = agent.format, agent.store.meta
    reply_ids = meta.token[(meta.turn == stopped.index) & (meta.role == 2)].tolist()
    assert fmt.decode(reply_ids) == shown  # every token shown is in the cache, and nothing else
    expected = fmt.system_prompt(None) + fmt.user_message(stopped.text) + reply_ids + fmt.next_user_header()
    assert meta.token.tolist() == expected and len(meta) == agent.store.length
    for piece in agent.stream("Go on."):  # interrupt(), as palace chat's Ctrl-C handler calls it
        agent.interrupt()
    assert len(agent.format.words(agent.history[-1].reply)) <= 2 and agent.chat("Thanks.") is not None
    assert len(agent.store.meta) == agent.store.length and agent.turn_index == 3


def test_an_agent_refuses_a_second_thread_and_two_agents_share_nothing(tiny_loaded, tiny_dir):
    config = palace_config(tiny_dir, budget=64, tokens=6)
    agent = Agent(tiny_loaded, config)
    reply = agent.stream("Hello there, I need help with an order.")
    next(reply)  # a turn is running on this thread
    errors = []
    worker = threading.Thread(target=lambda: errors.append(pytest.raises(AgentBusyError, agent.chat, "hi")))
    worker.start()
    worker.join()
    assert errors and "another thread" in str(errors[0].value)
    list(reply)
    alone = [conversed(tiny_loaded, config, TURNS[:3]).chat("What is my order number?") for _ in range(2)]
    together: dict[int, str] = {}

    def run(k: int) -> None:
        together[k] = conversed(tiny_loaded, config, TURNS[:3]).chat("What is my order number?")

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == {0: alone[0], 1: alone[1]} and alone[0] == alone[1]


def test_chat_session_resumes_saves_lists_and_ctrl_c_keeps_the_partial_reply(tiny_dir, tmp_path):
    palace = [str(Path(sys.executable).parent / "palace"), "chat", "--model", tiny_dir, "--budget", "96"]
    session = tmp_path / "sessions" / "dana"
    done = subprocess.run(palace + ["--session", str(session), "--max-new-tokens", "4"], capture_output=True, text=True,
                          env=ONE_THREAD, input="Hi, I'm Dana, order 448213.\nMy address is 14 Elm Road.\n", timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    again = subprocess.run(palace + ["--session", str(session)], capture_output=True, text=True, timeout=300, env=ONE_THREAD,
                           input="/stats\n/save\n/sessions\n/quit\n")
    assert again.returncode == 0, again.stderr
    assert "(resumed session" in again.stderr and "2 turns" in again.stderr
    assert any(line.split() == ["turns", "2"] for line in again.stdout.splitlines())
    assert f"(saved to {session})" in again.stdout and "dana (this one): 2 turns" in again.stdout
    (session / MANIFEST).write_text("{")  # a damaged session is one line, not a new conversation over it
    bad = subprocess.run(palace + ["--session", str(session)], capture_output=True, text=True, timeout=300, env=ONE_THREAD,
                         input="hi\n")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and MANIFEST in bad.stderr, bad.stderr
    # Ctrl-C as a terminal sends it: a suite started in the background (a shell without job control) passes its
    # children SIGINT ignored, which Python then keeps, and the chat's Ctrl-C at the prompt would do nothing
    child = subprocess.Popen(palace + ["--max-new-tokens", "4000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, bufsize=1, env=ONE_THREAD,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    child.stdin.write("Tell me everything.\n")
    child.stdin.flush()
    assert child.stdout.read(len("palace> ")) == "palace> "
    time.sleep(1.0)  # generating
    child.send_signal(signal.SIGINT)
    out = []
    while not out or out[-1].strip() != "(interrupted: the partial reply is kept)":
        out.append(child.stdout.readline())
    child.stdin.write("/stats\n")
    child.stdin.flush()
    while not out[-1].startswith("decode_tok_s"):  # /stats' last row: the chat goes on
        out.append(child.stdout.readline())
    assert any(line.split() == ["turns", "1"] for line in out)
    time.sleep(0.5)  # waiting for the next message: Ctrl-C there quits cleanly
    child.send_signal(signal.SIGINT)
    assert child.wait(timeout=120) == 0  # stdin still open: it was the Ctrl-C that ended the chat
    err = child.stderr.read()
    for stream in (child.stdin, child.stdout, child.stderr):
        stream.close()
    assert "Traceback" not in err, err
