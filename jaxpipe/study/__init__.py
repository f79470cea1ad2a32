"""The delay study as a library: its cells, running them, their results and report.

`tools/delay_study.py` is its command line. The pieces:

- `_cells`: the settings (sync, delay, delay-ef, delay-wp), the optimizers
  and their default rates, `Cell` and `Plan`, the cells of a study, a rate
  sweep and the 2bw check, and what a cell's run directory says
  (`cell_state`: done, resume, restart or new).
- `_runner`: `Runner`, the worker processes of train.py (pinned to cores,
  interrupted cleanly, resumed by rerunning).
- `_results`: final losses per optimizer and setting, gaps and the share the
  correction recovers (`summarize`), the tables and plots, the 2bw check's
  comparison and the gap against model size.
- `_report`: what each mode writes (results, sweep, sizes) and the journal
  of the invocations behind it.

Nothing here trains when imported, and everything but `Runner` works from
run directories already on disk.
"""

from jaxpipe.study._cells import (
    ROOT, TRAIN, DEFAULT_CONFIG, MARKER, OPTIMIZERS, DEFAULT_OPTIMIZERS, DEFAULT_LRS, SETTINGS,
    DEFAULT_SETTINGS, SETTING_LABELS, CONTROLLED, IGNORED_KEYS, SINGLE_THREAD_FLAGS, StudyError,
    Cell, fmt_lr, fmt_duration, parse_lrs, parse_optimizers, parse_settings, sweep_grid,
    git_commit, machine, say, write_marker, marker_wall, read_records, has_checkpoint,
    trajectory_config, cell_state, Plan, count_params, study_cells, sweep_cells, check_cells)
from jaxpipe.study._runner import (
    child_env, Runner)
from jaxpipe.study._results import (
    recovered_share, summarize, markdown_table, gap_length_table, plot_results, run_info,
    fmt_num, write_json, size_summary, size_table, plot_sizes, compare_check)
from jaxpipe.study._report import (
    journal_path, read_history, journal_update, study_meta, report_study, report_sweep,
    report_sizes)

__all__ = [
    "ROOT", "TRAIN", "DEFAULT_CONFIG", "MARKER", "OPTIMIZERS", "DEFAULT_OPTIMIZERS",
    "DEFAULT_LRS", "SETTINGS", "DEFAULT_SETTINGS", "SETTING_LABELS", "CONTROLLED",
    "IGNORED_KEYS", "SINGLE_THREAD_FLAGS", "StudyError", "Cell", "fmt_lr", "fmt_duration",
    "parse_lrs", "parse_optimizers", "parse_settings", "sweep_grid", "git_commit", "machine",
    "read_records", "has_checkpoint", "trajectory_config", "cell_state", "Plan", "count_params",
    "study_cells", "sweep_cells", "check_cells", "child_env", "Runner", "recovered_share",
    "summarize", "markdown_table", "gap_length_table", "plot_results", "write_json",
    "size_summary", "size_table", "plot_sizes", "compare_check", "journal_path", "read_history",
    "journal_update", "report_study", "report_sweep", "report_sizes", "say", "write_marker",
    "marker_wall", "run_info", "fmt_num", "study_meta",
]
