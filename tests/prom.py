"""Reading a server's `/metrics` with prometheus_client's own parser (a malformed exposition
raises)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    """One scrape: its families by name, and the value of one sample."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    @classmethod
    def of(cls, url: str, headers: dict[str, str] | None = None) -> Scrape:
        request = urllib.request.Request(url + "/metrics", headers=headers or {})
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return cls(resp.read().decode())

    def samples(self, name: str, **labels: str) -> list:
        """The samples called `name` whose labels include `labels`."""
        return [s for f in self.families.values() for s in f.samples
                if s.name == name and labels.items() <= s.labels.items()]

    def value(self, name: str, **labels: str) -> float:
        """The value of the one sample called `name` whose labels include `labels`."""
        found = self.samples(name, **labels)
        assert len(found) == 1, f"{len(found)} samples {name}{labels}"
        return found[0].value
