"""Every command in README.md's fenced code blocks, and how the tests check each one.

`commands()` reads README.md and returns one `Command` per example:
    ```bash     every non-empty, non-comment line (a trailing `# comment` stripped; `a ; b ; c` stays one command)
    ```console  every `$ ` line; the lines after it, up to the next `$ ` line, are its expected output
    ```python   the whole snippet
Untagged blocks (the run-directory tree) hold no commands.

`CHECKS` maps the exact text of every command to a `Check`: which runner runs it, and what is added to it (tiny
overrides so a training command takes seconds, sbatch flags that shrink a job to the sandbox, the sandbox's cluster
name for `a100_ib`) or what runs instead, always with the reason. tests/unit/test_readme.py fails when README.md
and this table disagree in either direction. The runners:

    cli       tests/unit/test_readme.py::test_cli_command          locally, as written (no training)
    local     tests/test_readme_slow.py::test_local_command         locally, trains or starts ranks (slow tier)
    sbatch    tests/slurm/test_readme_slurm.py::test_sbatch_command    on slurm_cluster (1 node x 8 fake GPUs)
    sbatch2   tests/slurm/test_readme_slurm.py::test_sbatch2_command   on slurm_cluster2 (2 nodes x 4 fake GPUs)
    srun, submit, jobctl, python   tests/slurm/test_readme_slurm.py, one test each, on slurm_cluster
    none      not run by pytest; `instead` names the commands (in DERIVED) that run in its place

Local commands run with bash in a scratch directory (`workdir`) holding symlinks configs/, sbatch/, tools/ to the
checkout, so relative paths resolve as in the README and runs/, data/ and job outputs land in the scratch directory.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.slurm.harness import NCCL_CHECK

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

# Appended to every command that trains: 2 steps on a 200k-token slice of the corpus, and a fixed device peak so no
# rank spends ~10 s measuring the CPU's matmul peak for the MFU column. Later overrides win, so `train.steps=2`
# replaces a step count the README line sets itself.
TINY = ("train.steps=2", "data.max_tokens=200000", "logging.peak_flops=1e11")
# The sandbox declares 128 CPUs on a 2-core machine: --cpus-per-task=16 would start 16 threads per rank and a
# 128-CPU job would keep every other job off the node.
ONE_CPU = "--cpus-per-task=1"
# train_13b.sh's `#SBATCH --exclusive` takes the sandbox's one node whole; =user still keeps other users' jobs off it
SHARE_NODE = "--exclusive=user"
# nccl_check on the sandbox: the arguments tests/slurm/test_nccl_check_slurm.py runs it with: small messages, few
# iterations (the CPU defaults sweep to 16 MiB x 20), and a slow-rank threshold of 0.1 x typical instead of 0.3, since
# four ranks timing 1 MiB transfers on 2 shared cores are noisy enough to "find" a slow rank at 0.3.
QUICK_NCCL = tuple(NCCL_CHECK)

RUNNERS = ("cli", "local", "sbatch", "sbatch2", "srun", "submit", "jobctl", "python", "none")


@dataclass(frozen=True)
class Command:
    """One example of README.md: `kind` is the fence's language (bash, console, python)."""

    kind: str
    text: str
    line: int  # 1-based line of README.md where it starts
    expected: tuple[str, ...] = ()  # console: the output lines shown after the command
    source: str = "README.md"  # the file, relative to the checkout (README.md or docs/X.md)


@dataclass(frozen=True)
class Check:
    """How one README command is checked. A command runs exactly as written unless `added`, `flags`, `replace` or
    `instead` say otherwise, and then `reason` says why."""

    runner: str
    added: tuple[str, ...] = ()  # arguments appended to the command (shell-quoted)
    flags: tuple[str, ...] = ()  # sbatch flags inserted just before the script: later sbatch flags win
    replace: tuple[tuple[str, str], ...] = ()  # (old, new) text substitutions; `{job}` in new = a job id
    instead: tuple[str, ...] = ()  # runner none: the DERIVED commands that run in its place
    expect: tuple[str, ...] = ()  # fragments its output must contain
    returncode: int = 0
    reason: str = ""
    # run in reading order (tests/test_readme_slow.py), every local command must change the scratch directory (a
    # run, a file) unless this says why it changes nothing (a dry run, a check that only prints)
    unchanged: str = ""

    @property
    def as_written(self) -> bool:
        return self.runner != "none" and not (self.added or self.flags or self.replace or self.instead)


def _python_list(items: tuple[str, ...]) -> str:
    return ", ".join(f'"{i}"' for i in items)


DONE = "done: step 2,"  # the CLI's last line after TINY's 2 steps
SANDBOX_ADDED = "tiny overrides appended; the sandbox's job environment (SLURM_CONF, PATH with this venv first)"

CHECKS: dict[str, Check] = {
    # ------------------------------------------------------------------------------------------ quick start
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[test]" && hpcdist train '
    "configs/demo.yaml": Check(
        "none",
        instead=("hpcdist train configs/demo.yaml",),
        reason="the venv + pip install part is the test line's setup, character for character (checked by "
        "test_quick_start_lines_share_the_ci_setup), which .ci/run executes from README.md itself; pip inside pytest "
        "would reinstall the package under test. Its training command runs in the slow tier with tiny overrides.",
    ),
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[test]" && python -m pytest -q '
    "-n 3": (
        Check(
            "none",
            reason=".ci/run reads this line from README.md and runs it (CI runs exactly this line); inside pytest "
            "it would run the whole suite, this test included, again",
        )
    ),
    # ----------------------------------------------------------------------------------- on a SLURM cluster
    "sbatch sbatch/train_13b.sh": Check(
        "none",
        instead=("hpcdist train configs/train_13b.yaml --dry-run --world-size 32",),
        reason="needs 4 nodes x 8 A100-80GB; the sandbox has 1 node and no GPU memory for 13B. Instead: the exact "
        "config at its exact world size through the dry run (ZeRO-3 plan on a meta model, memory fits), and the same "
        "batch script under SLURM is the next line (the smoke test: 1 node x 4 GPUs, tiny model), run on the sandbox",
    ),
    "sbatch --nodes=1 --ntasks-per-node=4 --gpus-per-node=4 sbatch/train_13b.sh model.preset=tiny data.source=stdlib "
    "data.seq_len=256 train.global_batch_size=16 train.steps=20 run.dir=runs/t": Check(
        "sbatch",
        flags=(ONE_CPU, SHARE_NODE),
        added=TINY,
        expect=("zero on 4 rank(s)", DONE),
        reason=f"{SANDBOX_ADDED}; {ONE_CPU} (the sandbox's 128 CPUs are 2 real cores); {SHARE_NODE} (train_13b.sh "
        "asks for whole nodes, and the sandbox has one: the other README jobs run beside it, not after it)",
    ),
    "sbatch sbatch/train.sh configs/demo.yaml train.steps=1000": Check(
        "sbatch",
        flags=(ONE_CPU,),
        added=TINY,
        expect=("ddp on 8 rank(s)", DONE),
        reason=f"{SANDBOX_ADDED}; {ONE_CPU} (the sandbox's 128 CPUs are 2 real cores)",
    ),
    "hpcdist submit configs/train_13b.yaml --cluster a100_ib --nodes 4 --dry-run": Check(
        "cli", expect=("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8")
    ),
    "hpcdist submit configs/demo.yaml --cluster a100_ib": Check(
        "submit",
        replace=(("--cluster a100_ib", "--cluster sandbox"),),
        added=TINY,
        reason="--cluster sandbox: the README's own instruction for the throwaway cluster (a100_ib asks for 8 GPUs "
        f"and a whole node with 16 CPUs per rank); {SANDBOX_ADDED}",
    ),
    "hpcdist status ; hpcdist logs JOB --rank 3 ; hpcdist cancel JOB": Check(
        "jobctl",
        replace=(("JOB", "{job}"),),
        reason="JOB = the id of a running 4-rank job submitted with `hpcdist submit configs/demo.yaml --cluster "
        "sandbox` (rank 3 needs 4 ranks; cancel needs a job that still runs)",
    ),
    # The python block, as one entry.
    'import hpcdist\n\njob = hpcdist.submit("configs/demo.yaml", ["train.steps=500"], cluster="a100_ib", nodes=1)\n'
    "print(job.job_id, job.state, job.paths[0].stdout)\njob.wait()": Check(
        "python",
        replace=(
            ('cluster="a100_ib"', 'cluster="sandbox"'),
            ('["train.steps=500"]', f'["train.steps=500", {_python_list(TINY)}]'),
        ),
        reason=f'cluster="sandbox" (the README\'s instruction for the throwaway cluster); {SANDBOX_ADDED}',
    ),
    # ------------------------------------------------------------------------------------------------ usage
    "hpcdist train configs/demo.yaml optim.lr=0.001 train.steps=100 run.dir=runs/lr": Check(
        "local", added=TINY, expect=(DONE,), reason="tiny overrides appended (train.steps=2 replaces 100)"
    ),
    "torchrun --nproc_per_node=4 -m hpcdist train configs/demo.yaml run.dir=runs/ddp4": Check(
        "local", added=TINY, expect=("ddp on 4 rank(s)", DONE), reason="tiny overrides appended"
    ),
    "srun --ntasks-per-node=8 hpcdist train configs/demo.yaml": Check(
        "srun", added=TINY, expect=("ddp on 8 rank(s)", DONE), reason=f"run on the sandbox; {SANDBOX_ADDED}"
    ),
    "hpcdist config configs/train_13b.yaml --world-size 32": Check(
        "cli", expect=("name: llama-13b", "global_batch_size: 256", "stage: 3")
    ),
    "hpcdist prepare my_texts/ --glob '*.txt' --out data/mycorpus": Check("cli", expect=("files into data/mycorpus",)),
    "hpcdist --version": Check("cli", expect=("hpcdist 0.1.0",)),
    "hpcdist train configs/demo.yaml train.steps=20 run.dir=runs/hf20 && hpcdist export runs/hf20 --out runs/hf20-hf "
    "&& hpcdist import runs/hf20-hf --out runs/hf20-imported": Check(
        "local",
        replace=(("train.steps=20", " ".join(TINY)),),
        expect=(DONE, "to runs/hf20-hf", "as runs/hf20-imported/step-00000000"),
        reason="tiny overrides replace train.steps=20 in the train step (the first command of the chain)",
    ),
    "hpcdist tokenizer train my_docs/ --vocab-size 512 --out data/tok && hpcdist prepare my_docs/ --tokenizer data/tok "
    "--out data/mydocs && hpcdist train configs/demo.yaml data.source=files data.path=data/mydocs "
    "model.vocab_size=auto run.dir=runs/mydocs": Check(
        "local",
        added=TINY,
        expect=("trained a byte-level BPE of 512 tokens", "tokenizer hf, vocab 512", DONE),
        reason="tiny overrides appended to the train step (the last command of the chain)",
    ),
    "hpcdist prepare my_docs/ --out data/mydocs-big --cluster a100_ib --tasks 32 --dry-run": Check(
        "cli",
        expect=("--array=0-31", "afterok:<array job>", "# task 31:"),
        unchanged="a dry run: prints the plan and the two sbatch scripts, writes nothing",
    ),
    "hpcdist data check data/mydocs --full": Check(
        "local",
        expect=("shards intact (sizes, checksums and ids)",),
        unchanged="a check: reads the dataset the chain above prepared, writes nothing",
    ),
    "hpcdist train configs/demo.yaml && hpcdist prepare my_texts/ --out data/heldout && hpcdist "
    'generate runs/demo --prompt "def main(" --max-new-tokens 64 --temperature 0.8 --top-k 40 --seed 1 && hpcdist eval '
    "runs/demo --data data/heldout --json runs/demo/eval.json": Check(
        "local",
        replace=(("configs/demo.yaml && ", f"configs/demo.yaml {' '.join(TINY)} && "),),
        # in reading order the quick start trained runs/demo already: the train step says so and changes nothing
        expect=("already finished at step 2", "def main(", "new tokens in", "step-00000002 on data/heldout: loss"),
        reason="tiny overrides inserted into the train step (the first command of the chain)",
    ),
    "lm_eval --model hf --model_args pretrained=runs/demo/hf,dtype=float32 --tasks hellaswag,arc_easy --batch_size 8 "
    "--device cpu": Check(
        "none",
        reason="lm-eval-harness is an optional tool, not a dependency (not installed in CI), and its tasks need their "
        "datasets, which cannot be downloaded here; the directory it reads comes from `hpcdist export`",
    ),
    # ---------------------------------------------------------------------------------------------- config
    "hpcdist train configs/demo.yaml train.stepz=3 optim.lr=fast": Check("cli", returncode=2),
    # ------------------------------------------------------------------------------------ communication check
    "sbatch sbatch/nccl_check.sh": Check(
        "sbatch2",
        flags=("--ntasks-per-node=2", "--gpus-per-node=2", ONE_CPU),
        added=QUICK_NCCL,
        expect=("2 host(s) (node1: ranks 0-1, node2: ranks 2-3)", "# Verdict: PASS"),
        reason="the sandbox's 2 nodes have 4 fake GPUs each and 2 real cores in all: 2 ranks per node, "
        f"{ONE_CPU}; QUICK_NCCL appended (small messages, few iterations, slow-rank threshold 0.1: timing noise)",
    ),
    "sbatch --nodes=8 sbatch/nccl_check.sh --json runs/nccl_check/8n.json": Check(
        "sbatch2",
        flags=("--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2", ONE_CPU),
        added=QUICK_NCCL,
        expect=("2 host(s) (node1: ranks 0-1, node2: ranks 2-3)", "# Verdict: PASS"),
        reason="--nodes=2 after --nodes=8 (the sandbox has 2 nodes), 2 ranks per node, "
        f"{ONE_CPU}; QUICK_NCCL appended (small messages, few iterations, slow-rank threshold 0.1: timing noise)",
    ),
    "tools/nccl_check --nproc 4": Check(
        "local",
        added=QUICK_NCCL,
        expect=("# Verdict: PASS",),
        reason="QUICK_NCCL appended (small messages, few iterations, slow-rank threshold 0.1): the CPU defaults "
        "sweep to 16 MiB x 20 iterations, 25 s of the suite for the same verdict",
        unchanged="a check: it prints its report and verdict (--json / --plot would write files)",
    ),
    # ------------------------------------------------------------------------------------------------- plan
    "hpcdist plan configs/train_13b.yaml --nodes 4 --gpus-per-node 8 --gpu-mem 80GB --tokens 1T": Check(
        "cli", expect=("auto would take row 1", "zero3", "2,142 tokens/s/GPU, 59.8% MFU")
    ),
    "hpcdist train configs/train_13b.yaml --dry-run --world-size 32 --ranks 0,9,31": Check(
        "local",
        expect=("13.02B params", "on 32 ranks", "fits in"),
        unchanged="a dry run: the plan on a meta model, printed; nothing trains, nothing is written",
    ),
    # ------------------------------------------------------------------------------------------------ docs/
    # docs/HF.md: the Python API, on the run the quick start trained (runs/demo)
    "from hpcdist.inference import load_for_inference  # a checkpoint (step / checkpoints / run dir) or HF dir\n\n"
    'model, tokenizer, loaded = load_for_inference("runs/demo")  # Transformer (eval, fp32), Tokenizer|None, where '
    "from\nfrom hpcdist.hf.convert import to_hf_state_dict, from_hf_state_dict  # full state dicts, names + "
    "permutation": Check("local", unchanged="it loads a checkpoint into memory: reads only"),
    # docs/PROFILING.md
    "python tools/bench/scaling.py configs/demo.yaml --ranks 1,2,4": Check(
        "local",
        replace=(("--ranks 1,2,4", "--ranks 1,2"),),
        added=("--steps", "1", "--warmup", "1"),
        expect=("scaling",),
        reason="1 and 2 ranks, 1 timed step after 1 warm-up: 4 ranks of 2-core CPU time per step are the "
        "benchmark's job, not the suite's",
    ),
    "torchfrtrace <run.dir>/hangs --prefix nccl_trace_rank_": Check(
        "none",
        reason="it reads NCCL flight-recorder dumps, which only an NCCL (GPU) run that hung writes; gloo here writes "
        "none (tests/dist/test_watchdog.py checks the dump path and the variables hpcdist sets)",
    ),
    "torchfrtrace <run.dir>/hangs --prefix nccl_trace_rank_ --allow-incomplete-ranks": Check(
        "none", reason="as the line above: needs an NCCL run's flight-recorder dumps"
    ),
}

# Commands that run in place of a README command (`Check.instead`), and how.
DERIVED: dict[str, Check] = {
    "hpcdist train configs/demo.yaml": Check("local", added=TINY, expect=(DONE,), reason="tiny overrides appended"),
    "hpcdist train configs/train_13b.yaml --dry-run --world-size 32": Check(
        "local",
        expect=("13.02B params", "on 32 ranks", "zero3 x 32 ranks", "fits in"),
        unchanged="a dry run: the plan on a meta model, printed; nothing trains, nothing is written",
    ),
}


# ------------------------------------------------------------------------------------------------ parsing

_FENCE = re.compile(r"^\s*```\s*([\w+-]*)\s*$")


def strip_comment(line: str) -> str:
    """`cmd args   # comment` -> `cmd args`: a `#` starts a comment at the line start or after whitespace, outside
    quotes (as bash reads it)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands(readme: Path = README) -> list[Command]:
    """Every command of the fenced bash / console / python blocks of `readme`, in order."""
    out: list[Command] = []
    lang: str | None = None
    block: list[tuple[int, str]] = []
    for number, line in enumerate(readme.read_text(encoding="utf-8").splitlines(), start=1):
        fence = _FENCE.match(line)
        if fence and lang is None:
            lang, block = fence.group(1).lower(), []
        elif fence and not fence.group(1):
            out += _block_commands(lang or "", block)
            lang = None
        elif lang is not None:
            block.append((number, line))
    return out


DOCS = sorted((REPO / "docs").glob("*.md"))


def documented() -> list[Command]:
    """Every command a reader meets: README.md's, then each docs/*.md's (alphabetical, as the README lists them)."""
    out = commands(README)
    for doc in DOCS:
        source = str(doc.relative_to(REPO))
        out += [Command(c.kind, c.text, c.line, c.expected, source) for c in commands(doc)]
    return out


def reading_order(runner: str = "local") -> list[Command]:
    """The commands of ``runner`` in the order a reader meets them; a command that does not run stands aside for
    the DERIVED commands that run in its place, at its place (the quick start's training runs first)."""
    out: list[Command] = []
    for c in documented():
        check = CHECKS.get(c.text)
        if check is None:
            continue
        if check.runner == runner:
            out.append(c)
        out += [Command("bash", t, c.line, (), c.source) for t in check.instead if DERIVED[t].runner == runner]
    return out


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    """{path: (size, mtime_ns)} of every file under ``root``, not following links (configs/ etc. are the checkout's):
    what a command changed."""
    state: dict[str, tuple[int, int]] = {}
    for dirpath, _, files in os.walk(root, followlinks=False):
        for name in files:
            path = Path(dirpath, name)
            try:
                st = path.lstat()
            except OSError:
                continue  # removed meanwhile
            state[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return state


def _block_commands(lang: str, block: list[tuple[int, str]]) -> list[Command]:
    if lang in ("bash", "sh", "shell"):
        found, pending, start = [], "", 0
        for number, line in block:
            text = strip_comment(line).strip()
            if not pending and not text:
                continue
            start = start if pending else number
            if text.endswith("\\"):  # a continued line is one command
                pending += text[:-1].rstrip() + " "
                continue
            found.append(Command("bash", pending + text, start))
            pending = ""
        return found
    if lang == "console":
        found = []
        for number, line in block:
            if line.startswith("$ "):
                found.append(Command("console", line[2:].strip(), number))
            elif found and line.strip():
                last = found[-1]
                found[-1] = Command(last.kind, last.text, last.line, (*last.expected, line.rstrip()))
        return found
    if lang in ("python", "py"):
        text = "\n".join(line for _, line in block).strip()
        return [Command("python", text, block[0][0])] if text else []
    return []  # untagged (the run-directory tree) or another language: not commands


def check_for(text: str) -> Check:
    """The Check of a README command or a DERIVED one."""
    return CHECKS[text] if text in CHECKS else DERIVED[text]


def runnable(runner: str) -> list[str]:
    """The commands a runner runs: README's and docs/'s commands with that runner, then DERIVED ones
    (deduplicated)."""
    texts = [c.text for c in documented() if c.text in CHECKS and CHECKS[c.text].runner == runner]
    texts += [t for t, check in DERIVED.items() if check.runner == runner]
    return list(dict.fromkeys(texts))


def command_id(text: str) -> str:
    """A short pytest id for a command: at most 80 characters, its start and its end ("python block" for a snippet)."""
    if "\n" in text:
        return "python block"
    return text if len(text) <= 80 else f"{text[:40]}...{text[-37:]}"


def as_run(text: str, check: Check, **subs: str) -> str:
    """The command line that actually runs: replacements, sbatch flags before the script, then `added`."""
    for old, new in check.replace:
        assert old in text, f"{old!r} is not in {text!r}"
        text = text.replace(old, new.format(**subs))
    if check.flags:
        script = re.search(r"\ssbatch/\S+\.sh(\s|$)", text)
        assert text.startswith("sbatch ") and script, f"no sbatch script in {text!r}"
        text = f"{text[: script.start()]} {' '.join(check.flags)}{text[script.start() :]}"
    if check.added:
        text = f"{text} {' '.join(shlex.quote(a) for a in check.added)}"
    return text


# --------------------------------------------------------------------------------------------- local runs

_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def workdir(path: Path) -> Path:
    """A scratch directory that looks like the checkout to the README's relative paths (configs/, sbatch/, tools/
    are symlinks) plus `my_texts/`, the input `hpcdist prepare my_texts/ ...` expects, and `my_docs/docs.jsonl`, the
    jsonl corpus of the tokenizer -> prepare -> train example."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("configs", "sbatch", "tools"):
        link = path / name
        if not link.exists():
            link.symlink_to(REPO / name, target_is_directory=True)
    texts = path / "my_texts"
    texts.mkdir(exist_ok=True)
    for module in sorted(Path(json.__file__).parent.glob("*.py")):  # a few standard library modules as text
        (texts / f"{module.stem}.txt").write_text(module.read_text(encoding="utf-8"), encoding="utf-8")
    docs = path / "my_docs"
    docs.mkdir(exist_ok=True)
    with open(docs / "docs.jsonl", "w", encoding="utf-8") as fh:  # a few hundred kB of standard library source
        for module in sorted((Path(json.__file__).parent.parent / "email").glob("*.py")):
            fh.write(json.dumps({"text": module.read_text(encoding="utf-8")}) + "\n")
    return path


def local_env() -> dict[str, str]:
    """This environment without SLURM / launcher variables, with this interpreter's bin dir first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in _LAUNCHER_VARS}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run_bash(
    command: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`bash -c COMMAND` in `cwd`, stdout and stderr together in `.stdout`."""
    return subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=env or local_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def assert_output(command: str, proc: subprocess.CompletedProcess[str], check: Check) -> None:
    """Exit status as the table says, and every `expect` fragment in the output."""
    tail = proc.stdout[-4000:]
    assert proc.returncode == check.returncode, f"`{command}` exited {proc.returncode}:\n{tail}"
    for fragment in check.expect:
        assert fragment in proc.stdout, f"`{command}`: {fragment!r} not in its output:\n{tail}"


def matches(expected: str, actual: str) -> bool:
    """One line of a README transcript against one printed line: equal, where `...` in the README stands for any
    text."""
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return re.fullmatch(pattern, actual) is not None
