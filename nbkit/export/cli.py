"""``python -m nbkit export SOURCE --to merged|gguf [--quant TYPE] --out PATH``.

SOURCE is a saved adapter folder (``trainer.save_model(...)`` of a PEFT run, e.g. the demo's
``nbkit-demo-out/adapter``; its base is read from ``adapter_config.json``, or given with ``--base``) or a model
folder (``save_pretrained``). A base recorded as a relative folder is found from any working directory (also
beside the adapter, ``source.resolve_base``); one that is neither here nor on a reachable Hub fails at once, saying
to pass ``--base``. ``--to merged`` writes the adapter merged into the original base to the folder
``--out``. ``--to gguf`` writes one GGUF file: ``--out`` ending in ``.gguf`` is the file, otherwise a folder that
gets ``<name>-<quant>.gguf``; an adapter is merged first (into ``<out>/merged`` when ``--keep-merged``, else a
temporary folder), in ``--dtype`` (default: the base's own dtype). Both check the result by logits (the merge
against the adapter model, within the rounding floor of the saved dtype measured on the model: ``merge_check``) and
exit 1 if a check fails, saying what looks wrong and what to do; ``--no-check`` skips them. A report (JSON) is
written beside the output; ``--push REPO`` uploads the output afterwards.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from .compare import ExportCheckError


def parse(argv: Sequence[str]) -> argparse.Namespace:
    from .gguf import QUANT_TYPES

    parser = argparse.ArgumentParser(prog="python -m nbkit export",
                                     description="Export a trained model: merged 16-bit weights or a GGUF file.")
    parser.add_argument("source", help="a saved adapter folder, or a model folder")
    parser.add_argument("--to", required=True, choices=["merged", "gguf"])
    parser.add_argument("--out", required=True, help="output folder (merged), or .gguf file / folder (gguf)")
    parser.add_argument("--quant", default="f16", choices=QUANT_TYPES,
                        help="GGUF type (default %(default)s); q4_k_m, q5_k_m and q6_k are llama.cpp's K-quant mixes, "
                             "q4_k_m the usual choice for llama.cpp and Ollama")
    parser.add_argument("--base", default=None,
                        help="the adapter's base model (a folder or Hub id), if its config names another or one "
                             "that is not here")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the merged weights' dtype (default: the base's own); float32 keeps the merge exact")
    parser.add_argument("--keep-merged", action="store_true", help="gguf from an adapter: keep the merged folder")
    parser.add_argument("--no-check", action="store_true", help="skip the logit checks")
    parser.add_argument("--name", default=None, help="the model's name in the GGUF metadata and file name")
    parser.add_argument("--push", default=None, metavar="REPO_ID", help="upload the output to this Hub repo")
    return parser.parse_args(list(argv))


def _merged_folder(args: argparse.Namespace, source, work: Path) -> Path:
    from .merge import merge_folder

    if source.kind == "model":
        return source.path
    out = Path(args.out) if args.to == "merged" else (
        (Path(args.out) if not args.out.endswith(".gguf") else Path(args.out).parent) / "merged"
        if args.keep_merged else work / "merged")
    report = merge_folder(source.path, out, base=args.base, dtype=args.dtype, check_logits=not args.no_check)
    (out / "nbkit-export.json").write_text(json.dumps(report.as_dict(), indent=1, default=str))
    print(f"merged ({report.base_weights}) -> {out}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the export; 0 on success, 1 when a check failed or the source cannot be exported, 2 on bad usage."""
    from .source import describe

    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        source = describe(args.source, args.base)
        with tempfile.TemporaryDirectory(prefix="nbkit-export-") as work:
            if args.to == "merged":
                if source.kind == "model":
                    print("nbkit export: SOURCE is a model folder: nothing to merge", file=sys.stderr)
                    return 2
                output = _merged_folder(args, source, Path(work))
            else:
                from .gguf import export_gguf, write_report

                folder = _merged_folder(args, source, Path(work))
                name = args.name or (source.path.parent.name if source.kind == "adapter" else source.path.name)
                target = Path(args.out)
                if target.suffix != ".gguf":
                    target = target / f"{name}-{args.quant}.gguf"
                report = export_gguf(folder, target, quant=args.quant, check_logits=not args.no_check, name=name)
                write_report(report)
                output = target.parent
                print(f"gguf {args.quant} ({report.arch}) -> {target}" +
                      (f"; Modelfile -> {report.modelfile}" if report.modelfile else ""))
            if args.push:
                from .push import push_to_hub

                print(f"uploaded: {push_to_hub(output, args.push)}")
    except ExportCheckError as error:
        print(f"nbkit export: check failed: {error}", file=sys.stderr)
        return 1
    except (FileNotFoundError, NotImplementedError, ValueError, OSError) as error:
        print(f"nbkit export: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0
