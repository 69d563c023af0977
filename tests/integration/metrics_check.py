"""Checks a Prometheus text exposition with a real parser and promtool's lint rules.

Run by router_api_test (RouterApiTest.MetricsFollowPrometheusConventions) with the system
python3: python3 metrics_check.py FILE. The parser is prometheus_client's
(text_string_to_metric_families, Debian's python3-prometheus-client). The rules are those of
`promtool check metrics`: every family has HELP and TYPE, counters end in _total, no counter
is named *_total_total, units are base units (seconds and bytes, never milliseconds or
kilobytes), byte counters end in _bytes_total, names are snake_case with the fmoe_ prefix (or
vllm: for the documented aliases of vLLM's names, router/metrics.h), and no sample is NaN or
negative where it counts. Exits 0 when the text passes; prints what failed
otherwise.
"""
import math
import re
import sys

from prometheus_client.parser import text_string_to_metric_families

NAME = re.compile(r"^(fmoe_|vllm:)[a-z0-9_]+$")
NON_BASE_UNITS = ("_milliseconds", "_microseconds", "_ms", "_us", "_kilobytes", "_megabytes",
                  "_mb", "_kb", "_percent", "_rate", "_per_second")


def main() -> int:
    text = open(sys.argv[1], encoding="utf-8").read()
    problems = []
    helps = set(re.findall(r"^# HELP (\S+) ", text, re.M))
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    if len(types) != len(re.findall(r"^# TYPE ", text, re.M)):
        problems.append("a TYPE line is repeated")
    families = list(text_string_to_metric_families(text))
    if not families:
        problems.append("no metric families")
    for family in families:
        name = family.name
        exposed = name + "_total" if family.type == "counter" else name
        if exposed not in types and name not in types:
            problems.append(f"{name}: no TYPE line")
        if exposed not in helps and name not in helps:
            problems.append(f"{name}: no HELP line")
        if not NAME.match(name):
            problems.append(f"{name}: not snake_case with the fmoe_ prefix")
        if any(name.endswith(u) or (u + "_") in name for u in NON_BASE_UNITS):
            problems.append(f"{name}: not in base units (seconds, bytes)")
        if family.type == "counter":
            if name.endswith("_total"):
                problems.append(f"{name}: counter named *_total_total")
            if "bytes" in name and not exposed.endswith("_bytes_total"):
                problems.append(f"{exposed}: a byte counter ends in _bytes_total")
        if family.type == "gauge" and name.endswith("_total"):
            problems.append(f"{name}: a gauge must not end in _total")
        if family.type in ("histogram", "summary") and name.endswith("_total"):
            problems.append(f"{name}: a {family.type} must not end in _total")
        for sample in family.samples:
            if math.isnan(sample.value):
                problems.append(f"{sample.name}{sample.labels}: NaN")
            if family.type in ("counter", "histogram") and sample.value < 0:
                problems.append(f"{sample.name}{sample.labels}: negative")
    for p in problems:
        print(p)
    print(f"{len(families)} families, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
