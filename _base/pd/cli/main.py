"""The `pd` command: one entry point, a subcommand per service or tool.

Each subcommand's flags live with the code that uses them (`add_*_parser` functions); this file
only wires them together. `pd <command> --help` explains every flag.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
from pathlib import Path

# subcommand -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS = {
    "generate": ("pd.cli.generate", "generate text in one process (the reference output)"),
    "prefill": ("prefill_node.main", "run a prefill node"),
    "decode": ("decode_node.main", "run a decode node"),
    "router": ("router.command", "run the OpenAI-compatible router"),
    "launch": ("pd.cli.launch", "start router + prefill + decode nodes on this host"),
    "serve": ("pd.cli.serve", "pd serve MODEL: vLLM's spelling of pd launch --model MODEL"),
    "bench": ("pd.cli.bench", "serving benchmark against the router or any OpenAI-compatible server"),
    "keygen": ("pd.cli.keygen", "make the deployment's CURVE keypair for --curve-keys"),
}


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


MODEL_DIR_COMMANDS = ("generate", "prefill", "decode", "router", "launch", "serve")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def model_dir_problem(args: argparse.Namespace) -> str | None:
    """One line when --model names no directory here (a hub id, most often), else None."""
    model = getattr(args, "model_dir", None) or getattr(args, "model", None)  # pd serve MODEL
    if args.command not in MODEL_DIR_COMMANDS or not model or Path(model).is_dir():
        return None
    if _HUB_ID.fullmatch(model) and not Path(model).exists():
        return (f"{model!r} is not a directory here: pd loads local model directories and "
                f"downloads nothing; fetch it first (huggingface-cli download {model} "
                f"--local-dir DIR) and give --model DIR")
    return f"no model directory at {model!r}"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand listed; only the module of `only` (the command being
    run) is imported to add its flags, so `pd --help` and a torch-free command stay light.
    `only=None` imports them all (for tools that inspect every flag)."""
    parser = argparse.ArgumentParser(
        prog="pd", description="pd: prefill/decode disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pd.config import ModelConfigError

    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(chosen if chosen in COMMANDS else "").parse_args(argv)
    setup_logging(getattr(args, "log_level", "warning"))
    problem = model_dir_problem(args)
    if problem:
        print(f"pd {args.command}: error: {problem}", file=sys.stderr)
        return 2
    try:
        return args._module.main(args) or 0
    except ModelConfigError as e:
        # a checkpoint pd would compute wrongly: one line, and nothing serves it
        print(f"pd {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
