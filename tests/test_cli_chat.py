"""The command line as a user meets it: `colibri chat` driven in a real terminal (tmux: send-keys,
capture-pane) against Engine.chat, `--chat-template` and the ChatML fallback of a model without a
template, `--version`, and serve's options (per-model flags, --config, the API key from a file or
the environment, --port checked before anything loads)."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from colibri_edge import ColibriError, Engine, COLIBRI_ERR_INVALID_ARGUMENT
from colibri_edge.requests.textio import FALLBACK_CHAT_TEMPLATE
from colibri_edge.serving import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "colibri_edge", "default_model")
N_NEW = 24


def norm(text: str) -> str:
    """Whitespace collapsed: a terminal wraps and pads what a reply's text holds."""
    return " ".join(text.split())


class Terminal:
    """A command in a detached tmux session on a socket of its own, 200 x 50."""

    def __init__(self, command: str):
        tmux = shutil.which("tmux")
        assert tmux, "tmux is part of make test's install (Makefile: $(VENV)/.test)"
        self.base = [tmux, "-L", f"colibri-test-{os.getpid()}"]
        subprocess.run(self.base + ["new-session", "-d", "-s", "chat", "-x", "200", "-y", "50", command],
                       check=True, env=dict(os.environ, COLIBRI_BACKEND="reference"))

    def screen(self) -> str:
        return subprocess.run(self.base + ["capture-pane", "-t", "chat", "-p", "-J", "-S", "-500"],
                              capture_output=True, text=True, check=True).stdout

    def send(self, line: str):
        subprocess.run(self.base + ["send-keys", "-t", "chat", "-l", line], check=True)
        subprocess.run(self.base + ["send-keys", "-t", "chat", "Enter"], check=True)

    def wait(self, pred, what: str, timeout=180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.screen()
            if pred(s):
                return s
            time.sleep(0.2)
        raise AssertionError(f"the terminal never showed {what} in {timeout} s:\n{self.screen()}")

    def close(self):
        subprocess.run(self.base + ["kill-server"], capture_output=True)


def prompts(screen: str) -> int:
    return sum(1 for line in screen.splitlines() if line.startswith(">"))


def test_colibri_chat_in_a_terminal():
    """Two turns, /stats, /reset and /exit in a real terminal: each reply is Engine.chat's greedy
    reply to the whole conversation so far (the second turn sees the first), and after /reset the
    first question gets the first answer again."""
    u1, u2 = "Tell me a fortune.", "What does json.dumps do?"
    with Engine.open(DEMO, backend="reference") as eng:
        r1 = eng.chat([{"role": "user", "content": u1}], max_new_tokens=N_NEW)
        r2 = eng.chat([{"role": "user", "content": u1}, {"role": "assistant", "content": r1},
                       {"role": "user", "content": u2}], max_new_tokens=N_NEW)
        r2_alone = eng.chat([{"role": "user", "content": u2}], max_new_tokens=N_NEW)
    assert norm(r1) and norm(r2) and r2 != r2_alone        # the second turn depends on the first
    term = Terminal(f"{sys.executable} -m colibri_edge chat --temperature 0 --repeat-penalty 1 "
                    f"--max-new-tokens {N_NEW}; echo CHAT-EXITED $?; sleep 60")
    try:
        term.wait(lambda s: prompts(s) == 1, "the first prompt")
        for i, line in enumerate([u1, u2, "/stats", "/reset", u1], start=2):
            term.send(line)
            screen = term.wait(lambda s, i=i: prompts(s) == i, f"prompt {i} after {line!r}")
        term.send("/exit")
        screen = term.wait(lambda s: "CHAT-EXITED" in s, "the chat's exit")
    finally:
        term.close()
    assert "CHAT-EXITED 0" in screen
    assert "embedded default model" in screen and "model chat template" in screen
    flat = norm(screen)
    first = flat.index(norm(u1) + " " + norm(r1))
    second = flat.index(norm(u2) + " " + norm(r2), first)
    stats = flat.index("last reply:", second)
    reset = flat.index("[conversation reset]", stats)
    assert flat.index(norm(u1) + " " + norm(r1), reset) > reset
    assert "of 2048 tokens; 2 exchanges kept" in flat[stats:reset]


def test_chat_command_drops_the_oldest_exchanges_past_the_context(monkeypatch, capsys):
    """Piped input, a 96-token context: the conversation keeps going with the oldest exchanges
    dropped, and a message that cannot fit at all is refused, not sent."""
    lines = iter(["Tell me a fortune."] * 6 + ["word " * 200, "/stats"])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr("builtins.input", fake_input)
    rc = cli.main(["chat", "--model", DEMO, "--backend", "reference", "--max-seq-len", "96", "--temperature", "0",
                   "--max-new-tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "the oldest 1 exchange(s) dropped" in out
    assert "does not fit the context of 96 tokens" in out
    assert "of 96 tokens" in out.split("last reply:")[-1]


def test_chat_template_flag_and_the_chatml_fallback(tmp_path, capsys):
    """A model without a template chats in ChatML, saying so once; --chat-template FILE (or the
    template text) replaces the model's; a template that is not Jinja is refused by name."""
    bare = tmp_path / "bare"
    shutil.copytree(DEMO, bare)
    os.remove(bare / "chat_template.jinja")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    with Engine.open(str(bare), backend="reference") as eng:
        assert eng.codec.template_source == "fallback"
        text = eng.codec.render_chat(msgs)
        eng.codec.render_chat(msgs)
        assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert eng.chat(msgs, max_new_tokens=4) is not None
    err = capsys.readouterr().err
    assert err.count("has no chat template") == 1 and "--chat-template" in err
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}[assistant] {% endif %}")
    for given in (str(tpl), tpl.read_text()):
        with Engine.open(DEMO, backend="reference", chat_template=given) as eng:
            assert eng.codec.template_source == "given"
            assert eng.codec.render_chat(msgs) == "[system] Be brief.\n[user] hi\n[assistant] "
    assert FALLBACK_CHAT_TEMPLATE not in tpl.read_text()
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ColibriError) as e:
        Engine.open(DEMO, backend="reference", chat_template=str(bad))
    assert e.value.code == COLIBRI_ERR_INVALID_ARGUMENT and "not valid Jinja" in e.value.message
    with pytest.raises(ColibriError) as e:
        Engine.open(DEMO, backend="reference", chat_template=str(tmp_path / "missing.jinja"))
    assert "cannot read it" in e.value.message
    r = subprocess.run([sys.executable, "-m", "colibri_edge", "run", "--model", DEMO, "--backend", "reference",
                        "--chat", "--prompt", "hi", "--chat-template", str(tpl), "--temperature", "0",
                        "--max-new-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_version_and_port():
    from colibri_edge import __version__
    r = subprocess.run([sys.executable, "-m", "colibri_edge", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"colibri {__version__}"
    r = subprocess.run([sys.executable, "-m", "colibri_edge", "serve", "--model", DEMO, "--port", "80000"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "a TCP port is a number from 0 to 65535" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_options_per_model_and_from_a_config(tmp_path):
    p = cli.build_parser()
    a = p.parse_args(["serve", "--max-seq-len", "512", "--threads", "1", "--model", "a=/m/a", "--max-seq-len", "1024",
                      "--expert-slots", "4", "--model", "b=/m/b", "--kv-cache-tokens", "2048",
                      "--memory-budget", "1G", "--memory-budget", "b=512M"])
    models, options, budgets, shared = cli.serve_plan(a)
    assert models == {"a": "/m/a", "b": "/m/b"}
    assert options == {"a": {"max_seq_len": 1024, "expert_slots": 4}, "b": {"kv_cache_tokens": 2048}}
    assert shared["max_seq_len"] == 512 and shared["num_threads"] == 1 and shared["kv_cache_tokens"] is None
    assert budgets == {"a": 1 << 30, "b": 512 << 20}
    a = p.parse_args(["serve", "--model", "x", "--cors", "http://a.test", "--cors", "http://b.test"])
    assert a.cors == ["http://a.test", "http://b.test"]                 # both origins kept, not the last
    # a second parse starts from nothing (no per-model state kept in the parser)
    assert cli.serve_plan(p.parse_args(["serve", "--model", "c=/m/c"]))[1] == {"c": {}}
    toml = tmp_path / "models.toml"
    toml.write_text('[models.demo]\npath = "/m/demo"\nmax_seq_len = 2048\nexperts_per_token = 1\n'
                    'memory_budget = "256M"\n[models.other]\npath = "/m/other"\n')
    jsn = tmp_path / "models.json"
    jsn.write_text(json.dumps({"models": {"demo": {"path": "/m/demo", "max_seq_len": 2048, "experts_per_token": 1,
                                                    "memory_budget": "256M"}, "other": {"path": "/m/other"}}}))
    for f in (toml, jsn):
        models, options, budgets, _ = cli.serve_plan(p.parse_args(["serve", "--config", str(f)]))
        assert models == {"demo": "/m/demo", "other": "/m/other"}
        assert options == {"demo": {"max_seq_len": 2048, "top_k": 1}, "other": {}}
        assert budgets == {"demo": 256 << 20}
    jsn.write_text(json.dumps({"models": {"demo": {"path": "/m", "max_seqlen": 1}}}))
    with pytest.raises(ColibriError) as e:
        cli.serve_plan(p.parse_args(["serve", "--config", str(jsn)]))
    assert "unknown option(s) max_seqlen" in e.value.message
    with pytest.raises(ColibriError) as e:
        cli.serve_plan(p.parse_args(["serve"]))
    assert "serve needs --model" in e.value.message


def test_api_key_from_a_file_or_the_environment(tmp_path, monkeypatch):
    p = cli.build_parser()
    monkeypatch.delenv("COLIBRI_API_KEY", raising=False)
    assert cli._api_key(p.parse_args(["serve", "--model", "x"])) is None
    monkeypatch.setenv("COLIBRI_API_KEY", "from-env")
    assert cli._api_key(p.parse_args(["serve", "--model", "x"])) == "from-env"
    f = tmp_path / "key"
    f.write_text("from-file\nsecond line\n")
    assert cli._api_key(p.parse_args(["serve", "--model", "x", "--api-key-file", str(f)])) == "from-file"
    assert cli._api_key(p.parse_args(["serve", "--model", "x", "--api-key", "flag"])) == "flag"
    f.write_text("\n")
    with pytest.raises(ColibriError) as e:
        cli._api_key(p.parse_args(["serve", "--model", "x", "--api-key-file", str(f)]))
    assert "first line is empty" in e.value.message


def test_inspect_defaults_to_what_serve_allocates(capsys):
    """inspect without a model inspects the embedded one, at the context serve opens it with, and
    the Engine.open line it prints allocates what it says."""
    assert cli.main(["inspect"]) == 0
    out = capsys.readouterr().out
    assert "maximum context: 2048 tokens" in out and "memory at context 2048 x batch 8" in out
    line = [l for l in out.splitlines() if "allocated at open" in l][0]
    with Engine.open(DEMO, backend="reference", max_seq_len=2048, max_batch=8, prefill_chunk=256) as eng:
        assert f"arena {eng.runner.arena_bytes} bytes" in line
    assert cli.main(["inspect", "--context", "100000"]) == abs(COLIBRI_ERR_INVALID_ARGUMENT)
    assert "maximum context of 2048 tokens" in capsys.readouterr().err


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch, capsys):
    with Engine.open(DEMO, backend="reference") as eng:
        eng.trace([[1, 2, 3, 4]]).save(str(tmp_path / "t.npz"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)        # as if the plot extra were not installed
    rc = cli.main(["stats", str(tmp_path / "t.npz"), "--plot", str(tmp_path / "heat.png")])
    assert rc == abs(COLIBRI_ERR_INVALID_ARGUMENT)
    assert "pip install 'colibri-edge[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "heat.png").exists()


def test_make_capi_installs_the_capi_extra_not_the_test_environment(tmp_path):
    """`make capi` on a fresh venv: the base install and the capi extra (cffi), never torch, cupy or
    pocl (the test extras); a dry run lists what it would do."""
    r = subprocess.run(["make", "-n", "capi", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "'.[capi]'" in r.stdout and "build_capi.py" in r.stdout
    assert "[test" not in r.stdout and "opencl" not in r.stdout and "cuda" not in r.stdout
