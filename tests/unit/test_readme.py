"""Every README command runs: README.md and the table of how each command is checked agree, and the
commands that neither train nor need SLURM run here, as written.

The training commands run in tests/test_readme_slow.py (slow tier), the SLURM ones in tests/slurm/test_readme_slurm.py
(on the sandbox); tests/readme_commands.py holds the parser and the table.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.readme_commands import (
    CHECKS,
    DERIVED,
    README,
    REPO,
    RUNNERS,
    Check,
    as_run,
    assert_output,
    check_for,
    command_id,
    commands,
    documented,
    matches,
    run_bash,
    runnable,
    strip_comment,
    workdir,
)

# runner -> the test function that runs its commands (file, function)
RUNNER_TESTS = {
    "cli": ("tests/unit/test_readme.py", "test_cli_command"),
    "local": ("tests/test_readme_slow.py", "test_local_commands_in_reading_order"),
    "sbatch": ("tests/slurm/test_readme_slurm.py", "test_sbatch_command"),
    "sbatch2": ("tests/slurm/test_readme_slurm.py", "test_sbatch2_command"),
    "srun": ("tests/slurm/test_readme_slurm.py", "test_srun_command"),
    "submit": ("tests/slurm/test_readme_slurm.py", "test_submit_command"),
    "jobctl": ("tests/slurm/test_readme_slurm.py", "test_jobctl_command"),
    "python": ("tests/slurm/test_readme_slurm.py", "test_python_block"),
}
HOW_TO_ADD = (
    "add an entry to CHECKS in tests/readme_commands.py with the command's exact text as the key and a "
    "Check(runner, ...) saying how it runs: 'cli' (locally as written, no training), 'local' (locally, trains: "
    "added=TINY), 'sbatch' / 'sbatch2' / 'srun' / 'submit' (on the SLURM sandbox, with flags= to shrink the job), "
    "or 'none' with instead= (commands in DERIVED) and a reason"
)


# ------------------------------------------------------------------------------------- README <-> table


def test_every_readme_command_has_a_check() -> None:
    """README.md's and docs/*.md's commands."""
    missing = [c for c in documented() if c.text not in CHECKS]
    assert not missing, "\n".join(
        [f"commands with no check ({HOW_TO_ADD}):"]
        + [f"  {c.source} line {c.line} ({c.kind}): {c.text!r}" for c in missing]
    )


def test_no_check_without_its_readme_command() -> None:
    texts = {c.text for c in documented()}
    stale = [t for t in CHECKS if t not in texts]
    assert not stale, "\n".join(
        [
            "CHECKS entries whose command is no longer in README.md or docs/ (update the key to the new text, or "
            "remove it):"
        ]
        + [f"  {t!r}" for t in stale]
    )


def test_readme_has_commands_of_every_kind() -> None:
    kinds = [c.kind for c in documented()]
    assert {"bash", "console", "python"} <= set(kinds), kinds
    everywhere = [c.text for c in documented()]
    assert len(everywhere) == len(set(everywhere)), "a command appears twice in README.md and docs/"


def test_docs_command_blocks_are_tagged() -> None:
    """A docs/ block that holds a command is a bash block (so the table above sees it); untagged blocks are
    diagrams, formulas, tables and the export/import synopsis (docs/HF.md, its placeholders in capitals)."""
    for doc in [REPO / "docs" / "PROFILING.md"]:
        assert "```bash\npython tools/bench/scaling.py" in doc.read_text(encoding="utf-8")
    assert {c.source for c in documented()} >= {"README.md", "docs/HF.md", "docs/PROFILING.md"}


@pytest.mark.parametrize("text", [*CHECKS, *DERIVED], ids=command_id)
def test_check_is_consistent(text: str) -> None:
    check = check_for(text)
    assert check.runner in RUNNERS, check.runner
    if not check.as_written:
        assert check.reason.strip(), f"{text!r} does not run as written: say why in reason="
    if check.runner == "none":
        assert check.instead or check.reason, text
        assert not (check.added or check.flags or check.replace), f"{text!r} is not run: nothing to add to it"
    for other in check.instead:
        assert other in DERIVED, f"{other!r} (instead of {text!r}) has no entry in DERIVED"
    if check.flags:
        assert text.startswith("sbatch "), f"flags= are sbatch flags: {text!r}"
    as_run(text, check, job="123")  # every replacement applies, the sbatch script is found
    if check.runner in RUNNER_TESTS:
        path, name = RUNNER_TESTS[check.runner]
        tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, f"{path}::{name}"


def test_every_derived_command_stands_in_for_one() -> None:
    used = {other for check in CHECKS.values() for other in check.instead}
    assert set(DERIVED) == used, set(DERIVED) ^ used


def test_quick_start_lines_share_the_ci_setup() -> None:
    """The main-job line is not run by pytest: its setup must be the test line's, which .ci/run runs (it greps the
    line ending in '# the tests' and runs everything before its last '&& python -m pytest')."""
    raw = [line for line in README.read_text(encoding="utf-8").splitlines() if line.rstrip().endswith("# the tests")]
    assert len(raw) == 1, raw
    test_line = strip_comment(raw[0])
    main = next(t for t in CHECKS if t.endswith(" && hpcdist train configs/demo.yaml"))
    setup, _, tests = test_line.rpartition(" && ")
    assert test_line in CHECKS and tests.startswith("python -m pytest -q")
    assert main.removesuffix(" && hpcdist train configs/demo.yaml") == setup
    assert CHECKS[main].instead == ("hpcdist train configs/demo.yaml",)


def test_commands_not_run_as_written_are_listed_with_a_reason() -> None:
    """Run with -s to see the list."""
    lines = []
    for command in commands():
        check = CHECKS.get(command.text)
        if check is None or check.as_written:
            continue
        assert check.reason.strip(), command.text
        if check.runner != "none":
            how = f"runs as: {as_run(command.text, check, job='JOB')}"
        else:
            how = f"not run; instead: {'; '.join(check.instead)}" if check.instead else "not run by pytest"
        lines.append(f"- line {command.line}: {command.text.splitlines()[0]}\n    {how}\n    why: {check.reason}")
    print(f"\nREADME commands not run exactly as written ({len(lines)}):\n" + "\n".join(lines))
    assert lines


# ------------------------------------------------------------------------------------------------ parser


def test_parser_reads_bash_console_and_python_blocks(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(
        "text `not a command`\n"
        "```bash\n"
        "# a comment line\n"
        "\n"
        "hpcdist prepare d/ --glob '*.txt' --out x   # then use it\n"
        "echo 'a # b' \"c # d\" e#f ; echo two   # comment\n"
        "run --long \\\n"
        "  --args\n"
        "```\n"
        "```\n"
        "runs/demo/\n"
        "  config.yaml\n"
        "```\n"
        "```console\n"
        "$ hpcdist train x.yaml\n"
        "hpcdist: error\n"
        "  - detail ...\n"
        "$ second\n"
        "```\n"
        "```python\n"
        "import hpcdist\n"
        "\n"
        "hpcdist.submit()\n"
        "```\n"
        "```yaml\n"
        "a: 1\n"
        "```\n",
        encoding="utf-8",
    )
    got = commands(readme)
    assert [(c.kind, c.text, c.line) for c in got] == [
        ("bash", "hpcdist prepare d/ --glob '*.txt' --out x", 5),
        ("bash", "echo 'a # b' \"c # d\" e#f ; echo two", 6),
        ("bash", "run --long --args", 7),
        ("console", "hpcdist train x.yaml", 15),
        ("console", "second", 18),
        ("python", "import hpcdist\n\nhpcdist.submit()", 21),
    ]
    assert got[3].expected == ("hpcdist: error", "  - detail ...")
    assert got[4].expected == ()


def test_as_run_inserts_sbatch_flags_before_the_script_and_appends() -> None:
    check = Check("sbatch", flags=("--nodes=2", "--x=1"), added=("a=1", "b c"), reason="r")
    assert as_run("sbatch --nodes=8 sbatch/s.sh --json j", check) == (
        "sbatch --nodes=8 --nodes=2 --x=1 sbatch/s.sh --json j a=1 'b c'"
    )
    assert as_run("x JOB y JOB", Check("jobctl", replace=(("JOB", "{job}"),), reason="r"), job="7") == "x 7 y 7"


def test_transcript_lines_match_with_elision() -> None:
    assert matches("  - a: x, y, ...", "  - a: x, y, z, w")
    assert matches("exact", "exact")
    assert not matches("exact", "exact and more")
    assert not matches("  - a: x, ...", "  - b: x, y")


# ------------------------------------------------------------------------------------------ the commands


@pytest.mark.parametrize("text", runnable("cli"), ids=command_id)
def test_cli_command(text: str, tmp_path: Path) -> None:
    """A README command that trains nothing, run as written with bash in a checkout-like scratch directory."""
    cwd = workdir(tmp_path)
    check = check_for(text)
    command = as_run(text, check)
    proc = run_bash(command, cwd, timeout=120)
    assert_output(command, proc, check)
    transcript = next((c for c in documented() if c.text == text and c.kind == "console"), None)
    if transcript is not None:  # the printed lines are the README's, `...` standing for the elided text
        printed = [line.rstrip() for line in proc.stdout.splitlines() if line.strip()]
        assert len(printed) == len(transcript.expected) and all(
            matches(e, p) for e, p in zip(transcript.expected, printed, strict=True)
        ), "{} line {}: `{}` prints\n{}\nbut it shows\n{}".format(
            transcript.source, transcript.line, text, "\n".join(printed), "\n".join(transcript.expected)
        )
    if text.startswith("hpcdist prepare "):  # "then data.source=files data.path=data/mycorpus"
        follow = "hpcdist config configs/demo.yaml data.source=files data.path=data/mycorpus"
        assert_output(follow, run_bash(follow, cwd, timeout=120), Check("cli", expect=("path: data/mycorpus",)))
