"""Step profiles for the trainer benchmarks: a callback that profiles chosen optimizer steps, per-module forward
ranges, and the summary tables (GPU kernel time by category, top kernels, top operators, module ranges); and the
GPU's idle time between kernels (``gap_tables``), from a profile of the GPU alone (no host-side recording, which
slows the host several times over and so would make every step look host-bound)."""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from typing import Any

import torch


class Profiled:
    """Profiles steps ``[start, start + count)`` of a run: a TrainerCallback that owns a torch.profiler session."""

    def __init__(self, start: int, count: int = 2, host: bool = True, stack: bool = False) -> None:
        from transformers import TrainerCallback

        self.start, self.count, self.prof = start, count, None
        outer = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step == outer.start and outer.prof is None:
                    on_gpu = torch.cuda.is_available()
                    acts = [torch.profiler.ProfilerActivity.CPU] if host or not on_gpu else []
                    if torch.cuda.is_available():
                        acts.append(torch.profiler.ProfilerActivity.CUDA)
                    outer.prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=stack)
                    outer.prof.__enter__()

            def on_step_end(self, args, state, control, **kw):
                if outer.prof is not None and state.global_step == outer.start + outer.count:
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    outer.prof.__exit__(None, None, None)

        self.callback = _CB()


@contextlib.contextmanager
def module_ranges(model: torch.nn.Module, inside_layers: bool = True):
    """Name each decoder submodule's forward (by type) in the profile: ``fwd:<attr>`` ranges around its calls.

    ``inside_layers=False``: no hook inside a decoder layer, one ``fwd:layer`` range around each layer instead. A
    hook inside a layer makes ``cuda_graphs`` run that layer eagerly (a graph would run the hook once, at its
    capture), so a profile of a graphed path must not split its layers, or it profiles another path than the one
    timed. The post hook runs even when the forward raises, so a range is never left open."""
    from torch.autograd.profiler import record_function

    from nbkit.model_parts import decoder_layers

    handles, stack = [], []
    wanted = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "rotary_emb",
              "embed_tokens", "norm"}
    layers = decoder_layers(model) or []
    inside = set() if inside_layers else {id(m) for layer in layers for m in layer.modules() if m is not layer}
    outer = set() if inside_layers else {id(layer) for layer in layers}
    for name, mod in model.named_modules():
        attr = name.rsplit(".", 1)[-1]
        if id(mod) in outer:
            label = "fwd:layer"
        elif id(mod) in inside:
            continue
        elif attr in wanted or attr.endswith("_proj") and "lora" not in name and name.count("base_layer") == 0:
            label = f"fwd:{attr}"
        else:
            continue

        def pre(m, a, label=label):
            r = record_function(label)
            r.__enter__()
            stack.append(r)

        def post(m, a, o):
            if stack:
                stack.pop().__exit__(None, None, None)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# first match wins: attention before GEMM (flash kernels' names carry "cutlass" template arguments)
KERNEL_CATEGORIES = [
    ("attention", r"flash|fmha|attention|varlen"),
    ("host copies (offload, side stream)", r"^Memcpy [DH]to[HD]"),
    ("matmul (GEMM)", r"gemm|cutlass|sm90_|sm100_|nvjet|cublas|splitk|xmma|_mm_"),
    ("bnb dequant", r"dequant|kDequant|kgemm_4bit"),
    ("triton", r"^triton_|_kernel$|liger|_fwd|_bwd"),
    ("copy / cast", r"copy|Copy|cast|convert"),
    ("reduction", r"reduce|Reduce|norm"),
    ("elementwise", r"elementwise|vectorized|Elementwise|unrolled"),
    ("memset / fill", r"memset|fill|Fill|zero"),
]


def profile_tables(prof: Any, steps: int) -> str:
    """Kernel time (ms per step) by category, the top kernels, the top operators, forward ranges per module."""
    cats: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    total = 0.0
    for e in prof.events():
        on_gpu = getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
        if not on_gpu or e.name.startswith(("fwd:", "autograd::")):
            continue  # the module ranges are annotations, not kernels
        t = e.device_time / 1000.0 / steps  # us -> ms per step
        total += t
        kernels[e.name[:90]] += t
        for cat, rx in KERNEL_CATEGORIES:
            if re.search(rx, e.name):
                cats[cat] += t
                break
        else:
            cats["other"] += t
    lines = [f"GPU kernel time per step: {total:,.1f} ms", "", "| category | ms/step | share |", "|---|---|---|"]
    lines += [f"| {c} | {t:,.1f} | {t / max(total, 1e-9):.1%} |" for c, t in sorted(cats.items(), key=lambda x: -x[1])]
    lines += ["", "| top kernels | ms/step |", "|---|---|"]
    lines += [f"| `{k}` | {t:,.2f} |" for k, t in sorted(kernels.items(), key=lambda x: -x[1])[:25]]
    ops = prof.key_averages()
    dev = lambda e: getattr(e, "self_device_time_total", 0.0)
    lines += ["", "| top operators (self GPU time) | ms/step | calls/step |", "|---|---|---|"]
    for e in sorted(ops, key=lambda e: -dev(e))[:25]:
        if dev(e) <= 0:
            break
        lines.append(f"| `{e.key[:80]}` | {dev(e) / 1000 / steps:,.2f} | {e.count / steps:,.0f} |")
    tot = lambda e: getattr(e, "device_time_total", 0.0)
    lines += ["", "| module forward ranges (incl. recompute) and backward nodes | GPU ms/step | calls/step |",
              "|---|---|---|"]
    rows = [e for e in ops if e.key.startswith("fwd:") or e.key.startswith("autograd::engine::evaluate_function")]
    for e in sorted(rows, key=lambda e: -tot(e))[:30]:
        lines.append(f"| `{e.key.replace('autograd::engine::evaluate_function: ', 'bwd:')[:80]}` | "
                     f"{tot(e) / 1000 / steps:,.1f} | {e.count / steps:,.0f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# the host side: where the Python time of a step goes


class HostProfiled:
    """Samples the host (the training thread's Python and the C calls it makes) over steps ``[start, start +
    count)`` with pyinstrument: a TrainerCallback that owns the sampler. Optional dependency: ``pip install
    pyinstrument``; a step's wall time under it is a few percent longer than without."""

    def __init__(self, start: int, count: int = 5, interval: float = 0.001) -> None:
        from pyinstrument import Profiler
        from transformers import TrainerCallback

        self.start, self.count, self.session = start, count, None
        self.profiler = Profiler(interval=interval)
        outer = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step == outer.start and not outer.profiler.is_running:
                    outer.profiler.start()

            def on_step_end(self, args, state, control, **kw):
                if outer.profiler.is_running and state.global_step == outer.start + outer.count:
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    outer.session = outer.profiler.stop()

        self.callback = _CB()


class FirstStepsSampled:
    """Samples the host over each of a run's first ``count`` optimizer steps on its own with pyinstrument, and over
    ``train()``'s start before them: one session each, in order. Why not one average: a fresh process's first steps
    each pay for something later ones do not (kernels compiled, the layer plan measured, graphs captured for a new
    row length), and an average over them would hide which step paid for what. Optional dependency, as
    ``HostProfiled``."""

    def __init__(self, count: int, interval: float = 0.001) -> None:
        from pyinstrument import Profiler
        from transformers import TrainerCallback

        self.count, self.sessions = count, []  # [(what, index of the step or None, session)]
        outer = self
        running: list = []

        def begin(what: str, index: int | None) -> None:
            running.append((what, index, Profiler(interval=interval)))
            running[-1][2].start()

        def end() -> None:
            if running:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                what, index, profiler = running.pop()
                outer.sessions.append((what, index, profiler.stop()))

        class _CB(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                begin("train() before step 1", None)

            def on_step_begin(self, args, state, control, **kw):
                end()  # train()'s start, before step 1
                if state.global_step < outer.count:
                    begin(f"step {state.global_step + 1}", state.global_step)

            def on_step_end(self, args, state, control, **kw):
                end()

        self.callback = _CB()

    def tables(self, step_ms: list[float], top: int = 12) -> str:
        """Each session's ``host_tables``, headed by what it sampled; ``step_ms``: the steps' wall times in order."""
        parts = []
        for what, index, session in self.sessions:
            wall = step_ms[index] if index is not None and index < len(step_ms) else None
            parts.append(f"#### {what}\n\n" + host_tables(session, 1, wall, top=top)[0])
        return "\n\n".join(parts)


# the host waiting for the GPU: calls that block until queued kernels finish
SYNC_CALLS = {"item", "tolist", "_local_scalar_dense", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__",
              "_cuda_synchronize", "synchronize"}
_SITE = re.compile(r"(?:site|dist)-packages/([^/]+)/(.*)$")


def host_owner(file_path: str) -> str:
    """Who a Python frame belongs to: a package (torch split into its parts that matter for a step), nbkit's
    module, or the standard library."""
    path = file_path.replace("\\", "/")
    m = _SITE.search(path)
    if m is None or m.group(1) == "nbkit":
        if "/nbkit/" in path or path.startswith("nbkit/"):
            tail = path.rsplit("nbkit/", 1)[1]
            return "nbkit." + tail.removesuffix(".py").replace("/", ".").split(".__init__")[0]
        if "/benchmarks/" in path or path.startswith("benchmarks/"):
            return "benchmarks (the timer)"
        return "python"
    pkg, rest = m.group(1), m.group(2)
    if pkg == "torch":
        for prefix, name in (("optim/", "torch.optim"), ("autograd/", "torch.autograd"), ("_dynamo/", "torch.compile"),
                             ("_inductor/", "torch.compile"),
                             ("utils/checkpoint", "torch checkpoint"), ("nn/", "torch.nn"), ("cuda/", "torch.cuda"),
                             ("utils/data", "torch data loading"), ("amp/", "torch.amp")):
            if rest.startswith(prefix):
                return name
        return "torch (other)"
    return pkg.split(".")[0]


def host_tables(session: Any, steps: int, step_ms: float | None = None, top: int = 30) -> tuple[str, dict[str, float]]:
    """Host time per step by owner, the host's waits for the GPU, and the top functions by self time.

    Each sample's time goes to the innermost Python frame's owner (a C call's time to the Python code that made
    it), except the calls that block on the GPU (``SYNC_CALLS``), which count as waiting. Returns the markdown
    and {owner: ms per step}."""
    owners: dict[str, float] = defaultdict(float)
    funcs: dict[str, float] = defaultdict(float)

    def walk(frame: Any, owner: str, where: str, waiting: bool) -> None:
        builtin = frame.file_path in ("<built-in>", None) or str(frame.file_path).startswith("<")
        if frame.is_synthetic:
            pass
        elif builtin:
            waiting = waiting or frame.function in SYNC_CALLS
        else:
            owner = host_owner(frame.file_path)
            waiting = waiting or frame.function == "synchronize"  # torch.cuda.synchronize, Event/Stream.synchronize
            where = f"{owner}: {frame.function} ({frame.file_path_short.rsplit('/', 1)[-1]}:{frame.line_no})"
        if not frame.children:
            t = frame.time * 1000 / steps
            owners["waiting for the GPU (a sync)" if waiting else owner] += t
            if not waiting:
                funcs[where] += t
        for child in frame.children:
            walk(child, owner, where, waiting)

    walk(session.root_frame(), "python", "python", False)
    total = sum(owners.values())
    base = step_ms or total
    lines = [f"host time sampled per step: {total:,.1f} ms" + (f" (step wall {step_ms:,.1f} ms)" if step_ms else ""),
             "", "| owner | ms/step | share of the step |", "|---|---|---|"]
    lines += [f"| {o} | {t:,.2f} | {t / max(base, 1e-9):.1%} |" for o, t in sorted(owners.items(), key=lambda x: -x[1])]
    lines += ["", "| top functions (self time, C calls included) | ms/step |", "|---|---|"]
    lines += [f"| `{f[:110]}` | {t:,.2f} |" for f, t in sorted(funcs.items(), key=lambda x: -x[1])[:top]]
    return "\n".join(lines), dict(owners)


def gap_tables(trace_path: str, steps: int, top: int = 15) -> str:
    """Where the GPU idles, from a chrome trace of GPU activity alone over ``steps`` steps: kernel (and copy) time
    merged across streams, the idle time between, and the largest gaps with the kernels on either side."""
    import json

    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not spans:
        return "no GPU activity in the trace"
    busy, gaps, end, last = 0.0, [], spans[0][0], spans[0][2]
    for start, stop, name in spans:
        if start > end:
            gaps.append((start - end, last, name))
        if stop > end:
            busy += stop - max(start, end)
            end, last = stop, name
    window = end - spans[0][0]
    idle = sum(g for g, _, _ in gaps)
    small = sum(g for g, _, _ in gaps if g < 20)
    lines = [f"GPU window {window / 1e3 / steps:.1f} ms/step: busy {busy / 1e3 / steps:.1f}, idle "
             f"{idle / 1e3 / steps:.1f} ({len(gaps) / steps:.0f} gaps a step; "
             f"{small / 1e3 / steps:.1f} ms in gaps under 20 us)", "",
             "| gap us | kernel before | kernel after |", "|---|---|---|"]
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"| {gap:,.0f} | `{before[:70]}` | `{after[:70]}` |")
    by_after: dict[str, float] = defaultdict(float)
    for gap, _, after in gaps:
        by_after[re.sub(r"<.*", "", after)[:60]] += gap
    lines += ["", "| kernel after the gap | idle ms/step before it |", "|---|---|"]
    for name, total in sorted(by_after.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| `{name}` | {total / 1e3 / steps:.2f} |")
    return "\n".join(lines)


def gap_host_tables(trace_path: str, steps: int, min_gap_us: float = 300.0, top: int = 12) -> str:
    """What the host ran while the GPU idled, from a chrome trace with host activity and Python stacks: for each GPU
    gap of at least ``min_gap_us``, the top-level host calls made between launching the work before the gap and
    launching the work after it (the host was late with the second launch; these calls are why). Recording the host
    slows it several times over, so the durations are inflated; which calls sit in the gap is what this tells."""
    import json

    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    host = sorted((e for e in events if e.get("cat") in ("python_function", "cpu_op", "cuda_runtime")),
                  key=lambda e: (e["ts"], -e.get("dur", 0)))
    if not gpu:
        return "no GPU activity in the trace"
    found: list[tuple[float, str, str, list[tuple[float, str]]]] = []
    end, last = gpu[0]["ts"] + gpu[0].get("dur", 0), gpu[0]
    for e in gpu[1:]:
        if e["ts"] - end >= min_gap_us:
            a = launches.get(last.get("args", {}).get("correlation"))
            b = launches.get(e.get("args", {}).get("correlation"))
            if a is not None and b is not None and b["ts"] > a["ts"]:
                lo, hi = a["ts"] + a.get("dur", 0), b["ts"]
                inside = [h for h in host if h["ts"] >= lo and h["ts"] + h.get("dur", 0) <= hi]
                outer, covered = [], -1.0
                for h in inside:  # top level: not inside an earlier call of the interval
                    if h["ts"] >= covered:
                        outer.append((h.get("dur", 0), h["name"]))
                        covered = h["ts"] + h.get("dur", 0)
                found.append((e["ts"] - end, last["name"], e["name"], sorted(outer, reverse=True)[:4]))
        if e["ts"] + e.get("dur", 0) > end:
            end, last = e["ts"] + e.get("dur", 0), e
    lines = [f"GPU gaps of {min_gap_us:.0f} us or more over {steps} steps: {len(found)}", "",
             "| gap us | kernel after | top-level host calls between the two launches (us, inflated by recording) |",
             "|---|---|---|"]
    for gap, _, after, calls in sorted(found, reverse=True)[:top]:
        what = "; ".join(f"{name[:60]} {dur:,.0f}" for dur, name in calls) or "(none recorded)"
        lines.append(f"| {gap:,.0f} | `{after[:50]}` | {what} |")
    return "\n".join(lines)
