"""``layerdiff logs diff``: compare the loss, learning rate and gradient norm of two training logs.

Split by what each part does: ``parse`` reads Megatron-LM, MindSpore Transformers, CSV and JSONL logs (detected
from the content, never the file name); ``compare`` aligns two of them by iteration under per-metric
tolerances; ``plot`` draws the curves; ``cli`` is the command. The names below are the public API.
"""
from layerdiff.logs.cli import EXIT_DIFFERENT, EXIT_OK, compare_files, register, render, run, verdict_line
from layerdiff.logs.compare import DEFAULT_TOLERANCES, diff, parse_tolerance, tolerances
from layerdiff.logs.parse import (
    FORMAT_NAMES,
    METRICS,
    PARSERS,
    LogLineError,
    detect_format,
    load_log,
    parse_csv,
    parse_jsonl,
    parse_megatron,
    parse_mindspore,
)
from layerdiff.logs.plot import render_html, write_plot

__all__ = ["DEFAULT_TOLERANCES", "EXIT_DIFFERENT", "EXIT_OK", "FORMAT_NAMES", "LogLineError", "METRICS", "PARSERS",
           "compare_files", "detect_format", "diff", "load_log", "parse_csv", "parse_jsonl", "parse_megatron",
           "parse_mindspore", "parse_tolerance", "register", "render", "render_html", "run", "tolerances",
           "verdict_line", "write_plot"]
