"""Quality tooling for looped models: a byte-level stdlib corpus, training a small Ouro from
scratch, evaluation of FlashLoop configurations against dense (perplexity and retrieval with
bootstrap CIs), the paper's redundancy findings, and calibration of retention / key fraction.

Submodules are imported on use (``from flashloop_compile.quality.evaluate import quality_table``);
see docs/QUALITY.md.
"""
