"""Shell completion through argcomplete's protocol, as the shells drive it: the command
runs with ``_ARGCOMPLETE=1`` and the line in ``COMP_LINE``/``COMP_POINT``, and writes
the candidates to the file named by ``_ARGCOMPLETE_STDOUT_FILENAME`` (or to fd 8, which
the bash script opens); and the scripts ``ralph-mail completion SHELL`` prints, sourced
in a real bash (zsh and fish when installed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ralph_mail import Team, create_team
from tests.helpers.processes import BOUND_S, cli_env, ralph


def complete(home: Path, line: str, tmp_path: Path, **env: str) -> list[str]:
    """The candidates ``ralph-mail`` offers for ``line`` with the cursor at its end."""
    out = tmp_path / "candidates"
    out.write_text("")
    protocol = {"_ARGCOMPLETE": "1", "COMP_LINE": line, "COMP_POINT": str(len(line))}
    protocol["_ARGCOMPLETE_STDOUT_FILENAME"] = str(out)
    done = subprocess.run(
        [sys.executable, "-m", "ralph_mail"],
        env=cli_env(home, **protocol, **env),
        capture_output=True,
        stdin=subprocess.DEVNULL,
        timeout=BOUND_S,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == b"" and done.stderr == b""  # nothing on the terminal
    text = out.read_text()
    return [word.rstrip() for word in text.split("\013")] if text else []


def on_path(tmp_path: Path) -> dict[str, str]:
    """A PATH where ``ralph-mail`` is this interpreter running this tree's package."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "ralph-mail"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ralph_mail "$@"\n')
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def script(home: Path, shell: str) -> str:
    done = ralph(home, "completion", shell)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


def test_a_partial_command_completes_to_the_commands_it_begins(home: Path, tmp_path: Path) -> None:
    """'ralph-mail se' -> search, send, serve; a bare TAB lists every command and group."""
    assert complete(home, "ralph-mail se", tmp_path) == ["search", "send", "serve"]
    everything = complete(home, "ralph-mail ", tmp_path)
    assert {"send", "read", "team", "policy", "completion"} <= set(everything)
    assert not [word for word in everything if word.startswith("-")]  # options once '-' is typed


def test_a_subcommand_completes_within_its_group(home: Path, tmp_path: Path) -> None:
    """'ralph-mail team c' -> config, create."""
    assert complete(home, "ralph-mail team c", tmp_path) == ["config", "create"]


def test_an_option_completes_and_so_do_its_choices(home: Path, tmp_path: Path) -> None:
    """Options by prefix, then the values of --priority and --type."""
    assert complete(home, "ralph-mail send --pri", tmp_path) == ["--priority"]
    assert "--backend" in complete(home, "ralph-mail read --", tmp_path)
    assert complete(home, "ralph-mail send --priority ", tmp_path) == [
        "low", "normal", "high", "urgent",
    ]  # fmt: skip
    assert complete(home, "ralph-mail send lead hi --type status_", tmp_path) == ["status_update"]
    assert complete(home, "ralph-mail completion ", tmp_path) == ["bash", "zsh", "fish"]


def test_agents_and_teams_come_from_the_home(team: Team, tmp_path: Path) -> None:
    """--agent, a recipient and --from complete the team's members; --team and
    'team show' the teams; and a TAB writes nothing into the home."""
    create_team("other", ["bob"], home=team.home)
    before = sorted(str(path) for path in team.home.rglob("*"))
    home = team.home
    assert complete(home, "ralph-mail send --team demo --agent ", tmp_path) == [
        "lead", "worker-1", "worker-2",
    ]  # fmt: skip
    assert complete(home, "ralph-mail send --team demo --agent w", tmp_path) == [
        "worker-1", "worker-2",
    ]  # fmt: skip
    assert complete(home, "ralph-mail ask ", tmp_path, RALPH_TEAM="other") == ["bob"]
    assert "bob" in complete(home, "ralph-mail search x --from ", tmp_path)  # no team: all
    assert complete(home, "ralph-mail read --team ", tmp_path) == ["demo", "other"]
    assert complete(home, "ralph-mail team show o", tmp_path) == ["other"]
    assert sorted(str(path) for path in team.home.rglob("*")) == before


def test_a_missing_home_or_a_server_completes_no_names(home: Path, tmp_path: Path) -> None:
    """No home, an unknown team or a NATS backend: no names, no error, exit 0."""
    assert complete(home, "ralph-mail send --agent ", tmp_path) == []
    assert not home.exists()
    assert complete(home, "ralph-mail send --team nope --agent ", tmp_path) == []
    create_team("demo", ["lead"], home=home)
    url = "nats://127.0.0.1:1"  # nothing listens: a TAB must not try
    assert complete(home, f"ralph-mail send --backend {url} --team demo --agent ", tmp_path) == []
    assert complete(home, "ralph-mail send --team demo --agent ", tmp_path, RALPH_BACKEND=url) == []


def test_a_normal_command_does_not_import_argcomplete(home: Path) -> None:
    """argcomplete is loaded only when the shell asks for completions."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ralph_mail", "--version"],
        env=cli_env(home), capture_output=True, timeout=BOUND_S,
    )  # fmt: skip
    assert done.returncode == 0
    assert b"ralph_mail.cli.completion" in done.stderr  # the command is registered
    assert b"argcomplete" not in done.stderr


def test_bash_sources_the_script_and_completes(team: Team, tmp_path: Path) -> None:
    """The bash script parses, registers ralph-mail, and its function (which talks to the
    command on fd 8) fills COMPREPLY."""
    code = script(team.home, "bash")
    path = tmp_path / "ralph-mail.bash"
    path.write_text(code)
    assert subprocess.run(["bash", "-n", str(path)], timeout=BOUND_S).returncode == 0
    probe = (
        f'source "{path}"\n'
        "complete -p ralph-mail\n"
        "for line in 'ralph-mail team c' 'ralph-mail send --team demo --agent worker-'; do\n"
        '  COMP_LINE="$line"; COMP_POINT=${#COMP_LINE}; read -ra COMP_WORDS <<< "$line"\n'
        "  COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))\n"
        '  _python_argcomplete ralph-mail "${COMP_WORDS[-1]}" "${COMP_WORDS[-2]}"\n'
        '  echo "${COMPREPLY[*]}"\n'
        "done\n"
    )
    done = subprocess.run(
        ["bash", "-c", probe], env=cli_env(team.home, **on_path(tmp_path)),
        capture_output=True, timeout=BOUND_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    registered, commands, agents = done.stdout.decode().splitlines()
    assert registered.endswith("-F _python_argcomplete ralph-mail")
    assert commands.split() == ["config", "create"]
    assert agents.split() == ["worker-1", "worker-2"]


def test_argcomplete_s_own_registration_works_too(team: Team, tmp_path: Path) -> None:
    """The script printed is argcomplete's: 'register-python-argcomplete ralph-mail'
    gives the same one, and the package carries the marker its global completion needs."""
    from argcomplete.shell_integration import shellcode

    assert script(team.home, "bash") == shellcode(["ralph-mail"], shell="bash")
    import ralph_mail.cli

    head = Path(ralph_mail.cli.__file__).read_text()[:1024]
    assert "PYTHON_ARGCOMPLETE_OK" in head


def test_zsh_script(team: Team, tmp_path: Path) -> None:
    """The zsh script registers with compdef; the answers for zsh carry descriptions.
    Without a zsh binary, only the script's text and the protocol are checked."""
    code = script(team.home, "zsh")
    assert "compdef _python_argcomplete ralph-mail" in code
    described = complete(team.home, "ralph-mail team c", tmp_path, _ARGCOMPLETE_SHELL="zsh")
    assert [word.split(":", 1)[0] for word in described] == ["config", "create"]
    assert all(word.split(":", 1)[1] for word in described)  # a description each
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed: the script's text and the protocol were checked")
    path = tmp_path / "ralph-mail.zsh"
    path.write_text(code)
    done = subprocess.run(
        ["zsh", "-fc", f'autoload -U compinit && compinit -u -D; source "{path}"; '
         'print -r -- "$_comps[ralph-mail]"'],
        env=cli_env(team.home, HOME=str(tmp_path)), capture_output=True, timeout=BOUND_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "_python_argcomplete"


def test_fish_script(team: Team, tmp_path: Path) -> None:
    """fish sources the script and completes through it (when fish is installed)."""
    code = script(team.home, "fish")
    assert "complete --command ralph-mail" in code
    if shutil.which("fish") is None:
        pytest.skip("fish is not installed: the script's text was checked")
    path = tmp_path / "ralph-mail.fish"
    path.write_text(code)
    done = subprocess.run(
        ["fish", "--no-config", "-c", f'source "{path}"; complete -C "ralph-mail team c"; '
         'complete -C "ralph-mail send --team demo --agent worker-"'],
        env=cli_env(team.home, HOME=str(tmp_path), **on_path(tmp_path)),
        capture_output=True, timeout=BOUND_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    names = [line.split("\t")[0] for line in done.stdout.decode().splitlines()]
    assert names == ["config", "create", "worker-1", "worker-2"]


def test_an_unknown_shell_is_a_usage_error(home: Path) -> None:
    """'completion tcsh': one line naming the shells, exit 2; --help shows an example."""
    done = ralph(home, "completion", "tcsh")
    assert done.returncode == 2
    assert b"give bash, zsh, fish" in done.stderr and done.stderr.count(b"\n") == 1
    helped = ralph(home, "completion", "--help")
    assert helped.returncode == 0 and b'eval "$(ralph-mail completion bash)"' in helped.stdout
