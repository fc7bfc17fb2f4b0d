"""Quality harness (installed as spec_adapt.eval): BERTScore, sentence-embedding cosine, reward-model deltas,
paired statistics, calibration controls, and the suite behind `spec-adapt eval`."""

from .quality_metrics import bertscore_f1, default_embedding_model, embedding_cosine, paired_stats, reward_scores

__all__ = ["bertscore_f1", "embedding_cosine", "reward_scores", "paired_stats", "default_embedding_model"]
