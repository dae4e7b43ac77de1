"""An Ollama ``Modelfile`` beside a GGUF file: ``FROM`` the file, the chat format as a Go template, stop tokens.

Ollama renders prompts with Go templates, not the Jinja chat template in the GGUF metadata. For the formats
recognised from the Jinja template's markers the Go translation below is written: ChatML (``<|im_start|>``:
Qwen, SmolLM, nbkit's demo tokenizer), Llama 3 (``<|start_header_id|>``), Gemma (``<start_of_turn>``) and
Mistral (``[INST]``). The template's default system prompt, if it writes one when none is given (SmolLM2 does),
becomes ``SYSTEM``. Stop tokens: the template's end-of-turn token, eos, and the format's turn markers.
An unrecognised format gets no ``TEMPLATE`` (Ollama then falls back on what it reads from the GGUF) and a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..reliability.stop_token import end_of_turn_token

logger = logging.getLogger(__name__)

_CHATML = """{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ .Content }}{{ if not $last }}<|im_end|>
{{ end }}
{{- end }}
{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant
{{ end }}
{{- end }}"""

_LLAMA3 = """{{- if .System }}<|start_header_id|>system<|end_header_id|>

{{ .System }}<|eot_id|>
{{- end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}<|start_header_id|>user<|end_header_id|>

{{ .Content }}<|eot_id|>{{ if $last }}<|start_header_id|>assistant<|end_header_id|>

{{ end }}
{{- else if eq .Role "assistant" }}<|start_header_id|>assistant<|end_header_id|>

{{ .Content }}{{ if not $last }}<|eot_id|>{{ end }}
{{- end }}
{{- end }}"""

_GEMMA = """{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}<start_of_turn>user
{{ if and $.System (eq $i 0) }}{{ $.System }}

{{ end }}{{ .Content }}<end_of_turn>
{{ if $last }}<start_of_turn>model
{{ end }}
{{- else if eq .Role "assistant" }}<start_of_turn>model
{{ .Content }}{{ if not $last }}<end_of_turn>
{{ end }}
{{- end }}
{{- end }}"""

_MISTRAL = """{{- range $i, $_ := .Messages }}
{{- if eq .Role "user" }}[INST] {{ if and $.System (eq (len (slice $.Messages $i)) 1) }}{{ $.System }}

{{ end }}{{ .Content }}[/INST]
{{- else if eq .Role "assistant" }} {{ .Content }}</s>
{{- end }}
{{- end }}"""

FORMATS = {  # name: (marker in the Jinja template, Go template, the format's own stop strings)
    "chatml": ("<|im_start|>", _CHATML, ("<|im_start|>", "<|im_end|>")),
    "llama3": ("<|start_header_id|>", _LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "gemma": ("<start_of_turn>", _GEMMA, ("<end_of_turn>",)),
    "mistral": ("[INST]", _MISTRAL, ("[INST]", "[/INST]")),
}


def chat_format(template: str | None) -> str | None:
    """The known format whose marker the Jinja chat template uses, or None."""
    for name, (marker, _, _) in FORMATS.items():
        if template and marker in template:
            return name
    return None


def _default_system(tokenizer: Any, fmt: str) -> str | None:
    """The system prompt a ChatML template writes when the chat has none (SmolLM2's), else None."""
    if fmt != "chatml":
        return None
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    except Exception:
        return None
    head = "<|im_start|>system\n"
    if isinstance(text, str) and text.lstrip().startswith(head):
        body = text.lstrip()[len(head):]
        return body.split("<|im_end|>", 1)[0] if "<|im_end|>" in body else None
    return None


def _quote(text: str) -> str:
    return '"""' + text.replace('"""', '\\"\\"\\"') + '"""'


def modelfile_text(gguf_name: str, tokenizer: Any) -> tuple[str, str | None]:
    """(the Modelfile's text, the recognised format or None)."""
    template = getattr(tokenizer, "chat_template", None)
    fmt = chat_format(template)
    lines = [f"FROM ./{gguf_name}", ""]
    stops: list[str] = []
    eot = end_of_turn_token(tokenizer)
    for token in (eot, getattr(tokenizer, "eos_token", None)):
        if token and token not in stops:
            stops.append(token)
    if fmt is None:
        logger.warning("nbkit export: the chat template is not one of %s: the Modelfile has no TEMPLATE; check "
                       "how Ollama formats prompts for this model", ", ".join(FORMATS))
    else:
        _, go, markers = FORMATS[fmt]
        lines += [f"TEMPLATE {_quote(go)}", ""]
        stops += [m for m in markers if m not in stops]
        system = _default_system(tokenizer, fmt)
        if system:
            lines += [f"SYSTEM {_quote(system)}", ""]
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    return "\n".join(lines) + "\n", fmt


def write_modelfile(gguf_path: str | Path, tokenizer: Any) -> Path:
    """Write ``Modelfile`` next to ``gguf_path`` (``ollama create NAME -f Modelfile`` in that folder)."""
    gguf_path = Path(gguf_path)
    text, _ = modelfile_text(gguf_path.name, tokenizer)
    path = gguf_path.parent / "Modelfile"
    path.write_text(text)
    return path
