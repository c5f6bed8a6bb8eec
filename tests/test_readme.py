"""README's two set-up commands stay true: CI runs README's test command, and the main job has no arguments."""

from support.paths import REPO



def _setup_commands():
    text = (REPO / "README.md").read_text()
    section = text.split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ")]


def test_readme_has_exactly_two_setup_commands():
    commands = _setup_commands()
    assert len(commands) == 2, commands
    assert commands[0].endswith("python examples/helloworld.py")
    assert "pytest" in commands[1]


def test_ci_runs_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    test_command = _setup_commands()[1]
    install_and_test = test_command.split(". .venv/bin/activate && ", 1)[1]
    assert install_and_test in ci
    assert "python3 -m venv .venv" in ci and ". .venv/bin/activate" in ci
