"""The coding agents' own CLIs from npm against `moeray serve --local` on the default model: Claude
Code (`claude -p --bare`, Anthropic's Messages API) and Codex (`codex exec` with a custom model
provider on the Responses API), configured as docs/agents/ tells a user to.

The CLIs are installed at test time (never at import) into the moeray cache folder
($MOERAY_CACHE_DIR or ~/.cache/moeray/agent-clis), pinned, once per machine; without npm or its
registry the tests skip and say why. The default model is small: it will not do a coding task, so
the tests assert what a user notices: the CLI exits 0 and prints the model's answer, with the
agent's tools in the prompt and its tool loop running.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

KEY = "cli-key-7"
QUESTION = "What is the capital of France? Answer in one word."
# Under the agents' tools the default model answers this one briefly (greedy): its reply ends itself.
YES_NO = "Is Paris in France? Answer yes or no."
# Pinned: what the tests were written against (their requests were captured and answered).
CLIS = {"claude": ("@anthropic-ai/claude-code", "2.1.197"), "codex": ("@openai/codex", "0.171.0")}
# Codex in a small context: its own short instructions instead of its long default prompt, and
# none of the tools this server cannot run or the context cannot hold (docs/agents/codex.md).
CODEX_DISABLE = ("multi_agent", "goals", "apps", "plugins", "image_generation", "skill_search")


def _cache() -> Path:
    return Path(os.environ.get("MOERAY_CACHE_DIR") or Path.home() / ".cache" / "moeray") / "agent-clis"


def _installed(folder: Path) -> bool:
    for package, version in CLIS.values():
        manifest = folder / "node_modules" / package / "package.json"
        if not manifest.exists() or json.loads(manifest.read_text()).get("version") != version:
            return False
    return True


@pytest.fixture(scope="module")
def clis() -> dict[str, Path]:
    """The CLIs' executables, installed by npm into the cache folder the first time."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the agent CLIs come from npm (Debian: apt install npm)")
    folder = _cache()
    if not _installed(folder):
        folder.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([npm, "install", "--prefix", str(folder), "--no-audit", "--no-fund",
                            *(f"{p}@{v}" for p, v in CLIS.values())], capture_output=True, text=True, timeout=900)
        if r.returncode != 0 or not _installed(folder):
            pytest.skip(f"npm could not install the agent CLIs (no registry?): {r.stderr.strip()[-400:]}")
    return {name: folder / "node_modules" / ".bin" / name for name in CLIS}


@pytest.fixture(scope="module")
def server(default_model_path):
    """`moeray serve --local` on the default model (8,192 tokens), answering any model name (the CLIs
    name their own models), a reply without a limit (Codex sets none) at most 256 tokens."""
    from serve_process import start_serve

    from moeray.stages.runtime.transport import free_port

    proc = start_serve([str(default_model_path), "--local", "--no-metrics", "--max-seqs", "2", "--any-model",
                        "--default-max-tokens", "256", "--api-key", KEY, "--ready-timeout", "300"], free_port(), timeout_s=420)
    try:
        yield proc
    finally:
        proc.stop()


def run_cli(argv: list, home: Path, env: dict, timeout_s: float = 900) -> subprocess.CompletedProcess:
    """A CLI run as a user runs it, in a fresh home and work folder (no user config is read)."""
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    full_env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", **env}
    return subprocess.run([str(a) for a in argv], cwd=work, env=full_env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout_s)


def claude_env(server) -> dict:
    return {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": KEY, "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


def test_claude_code_prints_the_models_answer(clis, server, tmp_path):
    r = run_cli([clis["claude"], "-p", QUESTION, "--bare", "--tools", ""], tmp_path, claude_env(server))
    assert r.returncode == 0, (r.stdout, r.stderr[-2000:])
    assert "Paris" in r.stdout, r.stdout


def test_claude_code_with_its_tools_runs_its_loop(clis, server, tmp_path):
    """Claude Code's Bash tool in the prompt (its schema, in the model's tool format), `echo` allowed
    and nothing else. The model answers, or calls Bash: each call reaches Claude Code as a tool_use
    with Bash's arguments, is denied, goes back as a tool_result, and the model goes on (this small
    one calls again until --max-turns ends the run). Either way no request of the loop fails."""
    r = run_cli([clis["claude"], "-p", YES_NO, "--bare", "--tools", "Bash", "--allowedTools", "Bash(echo *)",
                 "--max-turns", "3", "--output-format", "json"], tmp_path, claude_env(server))
    result = json.loads(r.stdout)
    assert result["type"] == "result", (r.stdout, r.stderr[-2000:])
    used = result["usage"]
    assert used["input_tokens"] + used.get("cache_read_input_tokens", 0) > 500  # the tool's schema was in the prompt
    if result["subtype"] == "success":
        assert r.returncode == 0 and result["result"].strip(), result
    else:  # the tool loop ran: calls out, denials back as tool results, turn after turn
        assert result["subtype"] == "error_max_turns" and result["num_turns"] > 1, result
        denied = result["permission_denials"]
        assert denied and all(d["tool_name"] == "Bash" and isinstance(d["tool_input"].get("command"), str)
                              for d in denied), denied


def codex_home(server, home: Path, model: str = "moeray") -> Path:
    folder = home / ".codex"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "instructions.md").write_text("You are a coding agent in a terminal. Answer briefly.\n")
    (folder / "config.toml").write_text(f'''model = "{model}"
model_provider = "moeray"
model_context_window = 8192
web_search = "disabled"
model_instructions_file = "{folder / 'instructions.md'}"

[model_providers.moeray]
name = "moeray"
base_url = "{server.url}/v1"
wire_api = "responses"
env_key = "MOERAY_API_KEY"
''')
    return folder


def test_codex_exec_prints_the_models_answer(clis, server, tmp_path):
    folder = codex_home(server, tmp_path)
    argv = [clis["codex"], "exec", "--skip-git-repo-check", "--json", "--sandbox", "read-only"]
    for feature in CODEX_DISABLE:
        argv += ["--disable", feature]
    r = run_cli(argv + [YES_NO], tmp_path, {"CODEX_HOME": str(folder), "MOERAY_API_KEY": KEY})
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert not [e for e in events if e.get("type") in ("error", "turn.failed")], events
    said = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
            and e["item"].get("type") == "agent_message"]
    assert said and said[-1].strip(), events
    (done,) = [e for e in events if e.get("type") == "turn.completed"]
    assert done["usage"]["input_tokens"] > 500 and done["usage"]["output_tokens"] > 0  # its tools were in the prompt
