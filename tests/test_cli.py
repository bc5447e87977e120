"""`lmserve generate` and `lmserve chat` as a user runs them: real processes on the embedded model."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import jsonschema
import pytest

from lmserve import cli
from lmserve.sampling_params import SamplingParams
from tests.conftest import write_tiny_llama

SMALL = ["--kv-cache-memory", str(64 * 2**20), "--num-threads", "2", "--temperature", "0"]


def lmserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmserve.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("quant,weights", [([], "gguf"), (["--quantization", "none"], None),
                                           (["--quantization", "int4"], "int4")], ids=["auto", "none", "int4"])
def test_generate_streams_a_greedy_completion(quant, weights):
    p = lmserve("--log-level", "info", "generate", "The capital of France is", "--max-tokens", "8", *SMALL, *quant)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Paris" in p.stdout
    # the load log says what runs; the default (auto) says what it chose and why
    assert (f"{weights} weights" in p.stderr) if weights else (" weights" not in p.stderr)
    assert ("--quantization auto: gguf (210 of 210 projection tensors are Q4_1 blocks" in p.stderr) == (not quant)


def test_chat_streams_replies_until_exit():
    p = lmserve("chat", "--max-tokens", "12", "--quantization", "none", *SMALL,  # float: the answer this test reads
                stdin="What is the capital of France?\n\n/exit\n")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("you> ") == 3  # the empty line is skipped, /exit ends the loop
    assert "assistant> " in p.stdout and "Paris" in p.stdout


def test_bad_quantization_flag_is_refused_by_the_parser():
    p = lmserve("generate", "hi", "--quantization", "int3")
    assert p.returncode == 2 and "invalid choice: 'int3'" in p.stderr


def test_generate_with_a_json_schema_file(tmp_path):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
              "required": ["city", "population"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    p = lmserve("generate", "Describe Paris as JSON.", "--chat-template", "--json-schema", str(path),
                "--max-tokens", "60", *SMALL)
    assert p.returncode == 0, p.stderr[-2000:]
    jsonschema.validate(json.loads(p.stdout), schema)
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "objekt"}')
    p = lmserve("generate", "hi", "--json-schema", str(bad), "--max-tokens", "4", *SMALL)
    assert p.returncode == 2 and 'Unsupported type "objekt"' in p.stderr and "Traceback" not in p.stderr


def test_generate_writes_only_the_text_to_stdout(offline_llm):
    """`lmserve generate ... > out.txt` holds the generated text and a newline; every log line is on stderr."""
    p = lmserve("--log-level", "info", "generate", "Hello", "--max-tokens", "8", "--temperature", "0",
                "--kv-cache-memory", str(64 * 2**20), "--num-threads", "2")
    assert p.returncode == 0, p.stderr[-2000:]
    expected = offline_llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert p.stdout == expected.outputs[0].text + "\n"
    assert "loaded SmolLM2" in p.stderr  # the logs were there, on stderr


def test_ctrl_c_aborts_the_reply_between_steps_and_frees_its_blocks(tmp_path):
    from lmserve.config import CacheConfig, EngineConfig
    from lmserve.engine.llm_engine import LLMEngine

    write_tiny_llama(tmp_path / "tiny")
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "tiny"), dtype="float32", num_threads=2,
                                    cache=CacheConfig(num_blocks=64)))
    step, steps = engine.step, []

    def step_then_ctrl_c():  # Ctrl-C lands while the third step runs
        steps.append(1)
        if len(steps) == 3:
            signal.raise_signal(signal.SIGINT)
        return step()

    engine.step = step_then_ctrl_c
    # Python's own handler first, as at an interactive prompt: a suite started in the background by a
    # non-interactive shell inherits SIGINT ignored, and _stream restores what it found
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        reply = cli._stream(engine, "r", "w5 w9 w17", SamplingParams(max_tokens=200, ignore_eos=True))
    finally:
        final = signal.signal(signal.SIGINT, before)
    assert reply.interrupted and len(steps) == 3  # the step that was running finished; no more ran
    assert not engine.has_unfinished() and engine.kv.num_free_blocks == engine.num_blocks
    assert final is signal.default_int_handler  # Ctrl-C raises again at the prompt


class Terminal:
    """`lmserve chat` on a pseudo-terminal it controls, so Ctrl-C typed there sends SIGINT as for a user."""

    def __init__(self, *args: str, sigint=signal.SIG_DFL) -> None:
        import fcntl
        import termios

        self.fd, slave = os.openpty()

        def setup() -> None:
            # a session leader (start_new_session) takes the pty as controlling terminal (TIOCSCTTY): the
            # line discipline then turns \x03 into SIGINT for it. SIGINT's handling as given (default: the
            # default, whatever this test process inherited; SIG_IGN: as a background job of a script)
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            signal.signal(signal.SIGINT, sigint)

        self.proc = subprocess.Popen([sys.executable, "-m", "lmserve.cli", *args], stdin=slave, stdout=slave,
                                     stderr=slave, start_new_session=True, preexec_fn=setup)
        os.close(slave)
        self.output = self.seen = ""

    def expect(self, text: str, timeout: float = 240) -> str:
        """Read until `text` appears after what earlier calls consumed; return what came before it."""
        deadline = time.time() + timeout
        while text not in self.output:
            ready, _, _ = select.select([self.fd], [], [], max(deadline - time.time(), 0))
            try:
                chunk = os.read(self.fd, 4096).decode(errors="replace") if ready else ""
            except OSError:  # the child exited and closed the terminal
                chunk = ""
            if not chunk:
                raise AssertionError(f"no {text!r}; the terminal shows: {(self.seen + self.output)[-2000:]!r}")
            self.output += chunk
        before, _, self.output = self.output.partition(text)
        self.seen += before + text
        return before

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self) -> int:
        return self.proc.wait(timeout=60)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.fd)


def test_chat_in_a_terminal_stops_a_reply_on_ctrl_c_and_exits_on_ctrl_d():
    t = Terminal("chat", "--max-tokens", "1000", "--quantization", "none", *SMALL)  # float: "Paris" below
    try:
        t.expect("/system TEXT")  # the hint, then the prompt
        t.expect("you> ")
        t.send("Write a long story about a dragon.\n")
        t.expect("assistant> ")
        t.expect("dragon")  # the reply is streaming
        t.send("\x03")
        t.expect("[interrupted")
        t.expect("you> ")
        t.send("What is the capital of France?\n")
        t.expect("assistant> ")
        assert "Paris" in t.expect("you> ")  # the next question gets its whole reply
        t.send("/reset\n")
        t.expect("[conversation cleared]")
        t.expect("you> ")
        t.send("half a question")
        t.expect("half a question")  # echoed: readline has it
        # CPython's readline loop sees SIGINT only while it waits in select(); one that lands while it
        # is still echoing waits for the next key. A person's Ctrl-C comes later than this test's would.
        time.sleep(0.5)
        t.send("\x03")  # Ctrl-C over typed text discards it, as in a shell
        t.expect("you> ")
        t.send("\x04")
        assert t.wait() == 0
    finally:
        t.close()
    assert "Traceback" not in t.seen + t.output


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN], ids=["default", "ignored"])
def test_chat_ctrl_c_at_an_empty_prompt_exits_cleanly(inherited):
    """Also where SIGINT came ignored (a script's background job): chat installs its own handling."""
    t = Terminal("chat", "--max-tokens", "8", *SMALL, sigint=inherited)
    try:
        t.expect("you> ")
        time.sleep(0.5)  # readline waits in select() by now (see the test above)
        t.send("\x03")
        assert t.wait() == 0
        while select.select([t.fd], [], [], 0.5)[0]:  # whatever it wrote while exiting
            try:
                chunk = os.read(t.fd, 4096).decode(errors="replace")
            except OSError:
                break
            if not chunk:
                break
            t.output += chunk
        assert "Traceback" not in t.seen + t.output
    finally:
        t.close()


def test_chat_image_command_attaches_an_image_to_the_next_message(tmp_path):
    """`/image PATH` on a tiny random Idefics3: the next reply is the one LLM.generate gives for the rendered turn
    with that image; a missing file is one bracketed line and the chat goes on; the image stays in the
    conversation for the following turn; a text-only model says it takes no images."""
    from lmserve.engine.llm import LLM
    from tests.vision_models import build_idefics3, image, image_bytes

    path = build_idefics3(tmp_path)[0]
    (tmp_path / "a.png").write_bytes(image_bytes(90, 50, seed=11))
    args = ["--model", str(path), "--dtype", "float32", "--device", "cpu", "--num-threads", "1", "--temperature", "0",
            "--max-tokens", "8"]
    p = lmserve("--log-level", "warning", "chat", *args, stdin=f"/image {tmp_path / 'none.png'}\n/image {tmp_path / 'a.png'}\nw5 w6\nw7\n/exit\n")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "[/image: " in p.stderr and "none.png" in p.stderr and "[image attached: " in p.stderr
    replies = [r.split("\n", 1)[0].strip() for r in p.stdout.split("assistant> ")[1:]]
    assert len(replies) == 2

    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=64, block_size=16)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    tok, img = llm.tokenizer, image(90, 50, seed=11)  # a.png's pixels
    first = [{"role": "user", "content": "<image>w5 w6"}]
    want = llm.generate([{"prompt": tok.apply_chat_template(first), "multi_modal_data": {"image": [img]}}], greedy,
                        use_tqdm=False)[0].outputs[0].text
    assert replies[0] == want.strip()
    second = [*first, {"role": "assistant", "content": want}, {"role": "user", "content": "w7"}]
    want2 = llm.generate([{"prompt": tok.apply_chat_template(second), "multi_modal_data": {"image": [img]}}], greedy,
                         use_tqdm=False)[0].outputs[0].text
    assert replies[1] == want2.strip()

    write_tiny_llama(tmp_path / "text")
    text = lmserve("--log-level", "warning", "chat", "--model", str(tmp_path / "text"), "--dtype", "float32",
                   "--num-threads", "1", "--max-tokens", "2", stdin=f"/image {tmp_path / 'a.png'}\nw5\n/exit\n")
    assert text.returncode == 0 and "does not accept images" in text.stderr and "Traceback" not in text.stderr
    assert text.stdout.count("assistant> ") == 1
