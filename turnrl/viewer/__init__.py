"""The trajectory viewer: ``turnrl view RUN_DIR`` writes one self-contained HTML page per run."""

from turnrl.viewer.page import ViewerError, load_run_tokenizer, make_server, serve, write_viewer

__all__ = ["ViewerError", "load_run_tokenizer", "make_server", "serve", "write_viewer"]
