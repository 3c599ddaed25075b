"""What a run left behind, read back and reported: goodput, summaries, bench reports and
plots, with one JSONL reader (:mod:`~diloco.runtime.jsonl`) and one duration grammar
(:mod:`~diloco.runtime.units`)."""
