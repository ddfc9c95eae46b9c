"""`graphpass inspect FILE.py:FUNCTION --input NAME=SHAPE:DTYPE ... [--arg NAME=VALUE] [--device cuda] [--json] [--dump DIR]`.

Captures the function with Dynamo on fake tensors (production shapes cost nothing), runs
graphpass's rewrite, and prints the captured graphs, each candidate region with its source line
and whether it was rewritten (and why not), and the memory table. Exit codes: 0 success,
1 graphpass failed, 2 a bad command line or spec, or the function fails on the given inputs
(the first line of its error and the line of the user's code that raised it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import os
import re
import sys

USAGE_EXAMPLE = ("graphpass inspect examples/ppo_loss.py:ppo_loss --input logits=32768x151936:bfloat16 "
                 "--input tokens=32768:int64 --input old_logp=32768 --input advantages=32768 "
                 "--input mask=32768 --arg temperature=0.7")

_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "float": "float32", "bf16": "bfloat16",
                  "fp16": "float16", "f16": "float16", "half": "float16", "fp64": "float64",
                  "double": "float64", "i64": "int64", "long": "int64", "i32": "int32", "int": "int32",
                  "bool": "bool", "u8": "uint8", "i8": "int8"}


class SpecError(ValueError):
    """A bad command line: reported in one line, exit code 2."""


def parse_dtype(text: str):
    import torch

    name = _DTYPE_ALIASES.get(text.strip().lower(), text.strip())
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SpecError(f"unknown dtype {text!r} (use e.g. float32, bfloat16, float16, int64, bool)")
    return dtype


def parse_input(spec: str):
    """"logits=32768x151936:bfloat16[:grad|:nograd]" -> (name, shape, dtype, requires_grad or None)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name.strip().isidentifier():
        raise SpecError(f"malformed --input {spec!r}: expected NAME=SHAPE[:DTYPE], e.g. logits=4096x32768:bfloat16")
    parts = rest.split(":")
    if len(parts) == 2 and parts[1] in ("grad", "nograd"):  # NAME=SHAPE:nograd, dtype defaulted
        parts.insert(1, "float32")
    shape_text, dtype_text = parts[0].strip(), (parts[1] if len(parts) > 1 else "float32")
    grad = None
    for flag in parts[2:]:
        if flag not in ("grad", "nograd"):
            raise SpecError(f"malformed --input {spec!r}: unknown flag {flag!r} (grad or nograd)")
        grad = flag == "grad"
    if shape_text in ("", "scalar", "()"):
        shape = ()
    else:
        try:
            shape = tuple(int(d) for d in shape_text.lower().split("x"))
        except ValueError:
            raise SpecError(f"malformed shape {shape_text!r} in --input {spec!r}: expected sizes joined "
                            "by 'x', e.g. 32768x151936") from None
        if any(d < 0 for d in shape):
            raise SpecError(f"malformed shape {shape_text!r} in --input {spec!r}: sizes must be >= 0")
    return name.strip(), shape, parse_dtype(dtype_text), grad


def parse_arg(spec: str):
    """"temperature=0.7" -> ("temperature", 0.7); ints, floats, True/False/None, else a string."""
    name, sep, text = spec.partition("=")
    if not sep or not name.strip().isidentifier():
        raise SpecError(f"malformed --arg {spec!r}: expected NAME=VALUE, e.g. temperature=0.7")
    text = text.strip()
    for conv in (int, float):
        try:
            return name.strip(), conv(text)
        except ValueError:
            pass
    consts = {"True": True, "False": False, "None": None}
    return name.strip(), consts.get(text, text)


def load_function(target: str):
    """"path/to/file.py:fn" (or "file.py:Class.method") -> the function object."""
    path, sep, qualname = target.rpartition(":")
    if not sep or not path or not qualname:
        raise SpecError(f"malformed target {target!r}: expected path/to/file.py:function")
    if not os.path.isfile(path):
        raise SpecError(f"no such file: {path}")
    module_name = "_graphpass_inspect_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise SpecError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise SpecError(f"cannot import {path}: {type(e).__name__}: {e}") from None
    obj = module
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise SpecError(f"{path} has no function {qualname!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SpecError(f"{path}:{qualname} is not callable")
    return obj


def bind_arguments(fn, tensor_specs, scalar_args, device="cpu"):
    """Fake tensors on `device` and scalars bound to `fn`'s parameters, checked against its signature."""
    import torch

    from graphpass import _torch_api

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    names = [n for n, _, _, _ in tensor_specs] + [n for n, _ in scalar_args]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise SpecError(f"argument given twice: {', '.join(sorted(dupes))}")
    if sig is not None:
        params = sig.parameters
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        unknown = [n for n in names if n not in params and not var_kw]
        if unknown:
            raise SpecError(f"{fn.__name__} has no parameter {unknown[0]!r} "
                            f"(parameters: {', '.join(params)})")
        missing = [n for n, p in params.items()
                   if p.default is inspect.Parameter.empty and n not in names
                   and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
        if missing:
            raise SpecError(f"missing --input or --arg for parameter {missing[0]!r} of {fn.__name__}")
    kwargs = {}
    with _torch_api.new_fake_mode(allow_real_tensors=True):  # as `explain`'s: code may make constants
        for name, shape, dtype, grad in tensor_specs:
            t = torch.empty(shape, dtype=dtype, device=device)
            # Float inputs need grad unless told otherwise: the loss is differentiated w.r.t. them.
            if (grad if grad is not None else dtype.is_floating_point):
                if not dtype.is_floating_point:
                    raise SpecError(f"--input {name}: a {dtype} tensor cannot require grad")
                t.requires_grad_(True)
            kwargs[name] = t
    kwargs.update(dict(scalar_args))
    if sig is not None:  # pass in signature order (positional where possible) for readable graphs
        kwargs = {n: kwargs[n] for n in sig.parameters if n in kwargs} | {
            n: v for n, v in kwargs.items() if n not in sig.parameters}
    return kwargs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphpass", description="graphpass: memory-efficient RL losses.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="show what graphpass rewrites in a loss function and what it saves",
                       description=__doc__, epilog="example: " + USAGE_EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="path/to/file.py:function")
    p.add_argument("--input", action="append", default=[], metavar="NAME=SHAPE[:DTYPE[:grad|:nograd]]",
                   help="a tensor argument, e.g. logits=32768x151936:bfloat16 (dtype defaults to float32; "
                        "float inputs require grad unless :nograd)")
    p.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE",
                   help="a Python scalar argument, e.g. temperature=0.7")
    p.add_argument("--json", action="store_true", help="print the report as JSON (nothing else on stdout)")
    p.add_argument("--dump", metavar="DIR", help="write each graph before/after each pass as <graph>.<stage>.<pass>.py")
    p.add_argument("--chunk-size", type=int, default=None, metavar="N", help="rows per chunk (default: automatic)")
    p.add_argument("--no-graphs", action="store_true", help="do not print the captured graphs")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="the device the inputs are on: its chunk sizes and kernels (cuda works without a GPU)")
    return parser


def traced_device(device: str) -> str:
    """The device to make the fake inputs on: `device`, except CUDA where no CUDA device is (a torch
    built without CUDA aborts autograd on fake CUDA tensors; one built with it, on a machine without
    a GPU, fails its first fake kernel), where `meta` stands in: graphpass takes the same path on
    every device but the CPU (`graphpass.ops.devices`)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("graphpass: note: no CUDA device here; the cuda configuration is traced on meta tensors, "
              "which take graphpass's accelerator path", file=sys.stderr)
        return "meta"
    return device


def _fail(message: str, code: int) -> int:
    print(f"graphpass: error: {message}", file=sys.stderr)
    return code


def inspect_command(args) -> int:
    try:
        from graphpass.config import Config

        config = Config(chunk_size=args.chunk_size)
    except ValueError as e:
        return _fail(str(e).removeprefix("graphpass: "), 2)
    try:
        tensor_specs = [parse_input(s) for s in args.input]
        scalar_list = [parse_arg(s) for s in args.arg]
        scalars = dict(scalar_list)
        with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
            fn = load_function(args.target)
        kwargs = bind_arguments(fn, tensor_specs, scalar_list, traced_device(args.device))
    except SpecError as e:
        return _fail(str(e), 2)

    from graphpass import _torch_api, inspection, report

    try:
        # With --json, stdout carries the JSON only: whatever the user's code prints goes to stderr.
        # torch logs a failing fake-tensor call with its traceback: the one line below says it.
        with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout), \
                _torch_api.quiet_fake_tensor_log():
            results = inspection.rewrite_results(fn, (), kwargs, config, dump_dir=args.dump)
        rep = inspection.build_report(
            results, function=args.target,
            inputs={n: report.describe_value(kwargs[n]) for n in [t[0] for t in tensor_specs] + list(scalars)},
            with_graphs=not args.no_graphs)
    except Exception as e:  # noqa: BLE001 - one line, whatever failed
        return _capture_failure(args.target, e)
    if args.json:
        sys.stdout.write(report.to_json(rep) + "\n")
    else:
        sys.stdout.write(report.render_text(rep, show_graphs=not args.no_graphs))
    return 0


# Dynamo's record of where in the user's code it was: `File "PATH", line N, in NAME` and the line.
_USER_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+), in \S+\n\s*(?P<code>[^\n]*)')


def _capture_failure(target: str, error: Exception) -> int:
    """One line for a failed capture. An error raised by the user's code on the given inputs
    (Dynamo wraps it: the cause is the innermost exception) is the inputs' fault: exit 2, with the
    user's line. Anything else failed inside graphpass or torch: exit 1."""
    from graphpass import _torch_api

    chain, seen = [], set()
    e = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(isinstance(x, _torch_api.backend_failure_type()) for x in chain):
        cause = chain[-1]
        return _fail(f"graphpass failed on {target}: {type(cause).__name__}: {_first_line(cause)} "
                     "(a bug in graphpass: please report it with this command line)", 1)
    cause = chain[-1]
    frames = [m for m in _USER_FRAME.finditer(str(error)) if not m["path"].startswith(_PACKAGE_DIR)]
    where = f" at {os.path.relpath(frames[-1]['path'])}:{frames[-1]['line']} ({frames[-1]['code'].strip()})" \
        if frames else ""
    return _fail(f"{target} fails on these inputs{where}: {type(cause).__name__}: {_first_line(cause)}; "
                 "check the --input shapes and dtypes against what the function expects", 2)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def main(argv=None) -> int:
    """Entry point of the `graphpass` command (pyproject: graphpass = "graphpass.cli:main")."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed a one-line usage error (code 2) or help (0)
        return int(e.code or 0)
    if args.command == "inspect":
        return inspect_command(args)
    return _fail(f"unknown command {args.command}", 2)


if __name__ == "__main__":
    sys.exit(main())
