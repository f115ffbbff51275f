"""The Grafana board shipped in the package (trt_sora/serve/grafana/trt_sora.json): every PromQL query
parses, and every metric and label it names is one the server's registry really exports."""
import json
import re
from importlib import resources

import pytest

pytest.importorskip("prometheus_client", reason="the server's metrics need the serve extra")

BOARD = resources.files("trt_sora.serve") / "grafana" / "trt_sora.json"

# PromQL's functions and aggregations (Prometheus 2.x/3.x); an unknown name is a typo in the board
AGGREGATIONS = {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
                "count_values", "group", "limitk", "limit_ratio"}
FUNCTIONS = {"abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "delta",
             "deriv", "exp", "floor", "histogram_quantile", "histogram_count", "histogram_sum", "histogram_avg",
             "histogram_fraction", "holt_winters", "idelta", "increase", "irate", "label_join", "label_replace",
             "ln", "log2", "log10", "predict_linear", "rate", "resets", "round", "scalar", "sort", "sort_desc",
             "sqrt", "time", "timestamp", "vector", "avg_over_time", "min_over_time", "max_over_time",
             "sum_over_time", "count_over_time", "quantile_over_time", "stddev_over_time", "last_over_time",
             "present_over_time"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset"}
#: labels Prometheus adds to every scraped series (not in the server's own exposition)
TARGET_LABELS = {"instance", "job"}

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<range>\[[^\[\]]*\])
  | (?P<number>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^(){},=<>])
""", re.X)


def lex(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot lex {expr[pos:pos + 20]!r} at column {pos} of {expr!r}")
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """``(metric names, label names)`` an instant-vector PromQL expression uses. ValueError on an
    unknown function, unbalanced brackets, a bad label matcher or a token PromQL has no place for."""
    try:
        return _names(lex(expr), expr)
    except IndexError:
        raise ValueError(f"{expr!r} ends inside a label list or matcher") from None


def _names(toks: list[tuple[str, str]], expr: str) -> tuple[set[str], set[str]]:
    metrics, labels, depth, i = set(), set(), 0, 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else None
        if kind == "ident" and text in GROUPING and nxt == "(":
            j = i + 2
            while toks[j][1] != ")":
                if toks[j][0] == "ident":
                    labels.add(toks[j][1])
                elif toks[j][1] != ",":
                    raise ValueError(f"{expr!r}: {toks[j][1]!r} in a {text} (...) label list")
                j += 1
            i = j + 1
            continue
        if kind == "ident" and nxt == "(":
            if text not in AGGREGATIONS | FUNCTIONS:
                raise ValueError(f"{expr!r}: unknown PromQL function {text!r}")
        elif kind == "ident" and (text in KEYWORDS or (text in AGGREGATIONS and nxt in ("by", "without"))):
            pass
        elif kind == "ident":
            metrics.add(text)
        elif text == "{":
            j = i + 1
            while toks[j][1] != "}":
                (k1, lab), (_, op), (k3, _val) = toks[j:j + 3]
                if k1 != "ident" or op not in ("=", "!=", "=~", "!~") or k3 != "string":
                    raise ValueError(f"{expr!r}: bad label matcher near {lab!r}")
                labels.add(lab)
                j += 3
                if toks[j][1] == ",":
                    j += 1
            i = j + 1
            continue
        elif text == "(":
            depth += 1
        elif text == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{expr!r}: unbalanced ')'")
        elif text == "}":
            raise ValueError(f"{expr!r}: unbalanced '}}'")
        i += 1
    if depth:
        raise ValueError(f"{expr!r}: unbalanced '('")
    return metrics, labels


def exported() -> tuple[dict[str, str], dict[str, set[str]]]:
    """``(sample name -> family name, family name -> label names)`` of a fresh ServerMetrics: the
    families of its registry's exposition, their samples (``_bucket``/``_count``/``_sum`` of a
    histogram, ``_total`` of a counter, the gauge itself) and the labels each family carries."""
    from prometheus_client.parser import text_string_to_metric_families

    from trt_sora.serve.metrics import ServerMetrics

    m = ServerMetrics()
    body, _ = m.exposition()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",),
                "summary": ("_count", "_sum", "")}
    samples: dict[str, str] = {}
    for fam in text_string_to_metric_families(body.decode()):
        if fam.name.endswith("_created"):  # the parser's view of a histogram's creation time, not a metric we chart
            continue
        for suffix in suffixes[fam.type]:
            samples[fam.name + suffix] = fam.name
        for s in fam.samples:
            samples[s.name] = fam.name
    # a labelled family exports no sample until its first child: its label names come from the collector
    families: dict[str, set[str]] = {}
    for metric in vars(m).values():
        if isinstance(metric, m.pc.metrics.MetricWrapperBase):
            families[metric.describe()[0].name] = set(metric._labelnames)
    assert set(families) == set(samples.values())
    return samples, families


def board_queries(board: dict) -> list[tuple[str, str]]:
    """``(where, expr)`` of every panel target (rows included) of the board."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((f"panel {p['title']!r} target {t['refId']}", t["expr"]))
            walk(p.get("panels", []))

    walk(board["panels"])
    return out


def check_board(board: dict) -> list[str]:
    """Every problem of the board's queries, as a line each (an empty list: all good)."""
    samples, families = exported()
    problems, seen = [], set()
    queries = board_queries(board)
    for var in board["templating"]["list"]:  # label_values(metric, label) feeds the instance picker
        q = var.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q or "")
        if m:
            queries.append((f"variable {var['name']!r}", f"group by ({m.group(2)}) ({m.group(1)})"))
    for where, expr in queries:
        try:
            metrics, labels = promql_names(expr)
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if not metrics:
            problems.append(f"{where}: names no metric: {expr!r}")
        unknown = sorted(metrics - set(samples))
        if unknown:
            problems.append(f"{where}: {', '.join(unknown)} not exported by the server: {expr!r}")
        fams = {samples[n] for n in metrics if n in samples}
        seen |= fams
        allowed = TARGET_LABELS | {"le" for n in metrics if n.endswith("_bucket")}
        allowed |= set().union(*(families[f] for f in fams)) if fams else set()
        if labels - allowed:
            problems.append(f"{where}: label(s) {sorted(labels - allowed)} not on {sorted(fams)}: {expr!r}")
    missing = sorted(set(families) - seen)
    if missing:
        problems.append(f"the server exports {', '.join(missing)} but no panel shows it: add one")
    return problems


def test_board_queries_name_only_exported_metrics_and_labels():
    board = json.loads(BOARD.read_text())
    assert len(board_queries(board)) >= 15
    assert check_board(board) == []


def test_board_panels_cover_the_serving_questions():
    """Throughput, queue, latency per stage, memory, errors and rejections each have their panel,
    built on the metric that answers it."""
    board = json.loads(BOARD.read_text())
    by_title = {}
    for where, expr in board_queries(board):
        by_title.setdefault(where.split("'")[1], []).append(expr)
    want = {"Throughput": "trt_sora_jobs_total", "Queue depth": "trt_sora_queue_depth",
            "Queue wait": "trt_sora_queue_wait_seconds_bucket", "Job latency": "trt_sora_job_seconds_bucket",
            "Transformer call": "trt_sora_transformer_call_seconds_bucket",
            "HTTP request": "trt_sora_http_request_seconds_bucket", "GPU memory": "trt_sora_gpu_memory_bytes",
            "Host RSS": "trt_sora_host_rss_bytes", "HTTP errors": "trt_sora_http_requests_total",
            "Rejected": "trt_sora_rejected_total"}
    for prefix, metric in want.items():
        exprs = [e for t, es in by_title.items() if t.startswith(prefix) for e in es]
        assert exprs and any(metric in promql_names(e)[0] for e in exprs), prefix
    for prefix in ("Queue wait", "Job latency", "Transformer call", "HTTP request"):
        exprs = [e for t, es in by_title.items() if t.startswith(prefix) for e in es]
        assert sorted(re.search(r"histogram_quantile\(([\d.]+),", e).group(1) for e in exprs) == ["0.5", "0.95"]
    errors = next(es for t, es in by_title.items() if t.startswith("HTTP errors"))[0]
    assert re.search(r'status=~"\[45\]\.\."', errors) and "by (route, status)" in errors


@pytest.mark.parametrize("bad, message", [
    ("trt_sora_job_seconds_bucket", "trt_sora_job_second_bucket not exported"),   # a misspelt metric
    ("sum by (status)", "label(s) ['code'] not on"),                               # a label it lacks
    ("histogram_quantile(0.5,", "unknown PromQL function 'histogram_quantil'"),    # a misspelt function
])
def test_a_broken_board_is_caught(bad, message):
    text = BOARD.read_text()
    assert bad in text
    broken = text.replace(bad, {"trt_sora_job_seconds_bucket": "trt_sora_job_second_bucket",
                                "sum by (status)": "sum by (code)",
                                "histogram_quantile(0.5,": "histogram_quantil(0.5,"}[bad], 1)
    problems = check_board(json.loads(broken))
    assert len(problems) == 1 and message in problems[0], problems


def test_lexer_and_parser_on_known_expressions():
    assert promql_names('sum by (le, route) (rate(a_bucket{x="}", y=~"[45].."}[$__rate_interval]))') == \
        ({"a_bucket"}, {"le", "route", "x", "y"})
    assert promql_names("sum(rate(a_sum[5m])) / sum(rate(a_count[5m])) > bool 2") == ({"a_sum", "a_count"}, set())
    for bad in ("sum(a", "a)", "a{b=c}", "a{b}", "$x", "sum by (le", "a}"):
        with pytest.raises(ValueError):
            promql_names(bad)
