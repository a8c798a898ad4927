"""A made-up company's traffic, recorded through a live gateway, for the tuning loop at demo
scale (``specgate tune measure`` / ``train`` on it).

    python -m bench.company --data-dir DIR [--requests 300] [--max-tokens 48] [--clients 8]

Alpmatt Logistik AG runs four internal applications on the gateway, each with its own API key:
``dispatch-assistant`` (customer replies about shipments), ``policy-desk`` (questions on internal
rules), ``code-review`` (short reviews of snippets) and ``delivery-extract`` (JSON from delivery
notes). Requests are drawn from templates with seeded slots, by a few dozen employees (the
``user`` field, so each is a data subject), and kept apart from the demo's distillation prompts
and the benchmark's prompt sets: what a retrained proposer learns from them is this traffic's
own regularities, not the benchmark's.

The gateway stores content (``store_content``) and serves the demo target; each request asks
for up to ``--max-tokens`` (48), the budget a replay by ``specgate tune`` keeps, sent by
``--clients`` (8) clients at once. The configuration written to ``DIR/gateway.yaml`` is the one
``specgate tune`` then reads.
"""

from __future__ import annotations

import argparse
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml

APPS: dict[str, tuple[str, list[str]]] = {
    "dispatch-assistant": (
        "You are Alpmatt Logistik's dispatch assistant. Answer customers politely and briefly.",
        [
            "My parcel {ref} was supposed to arrive in {city} on {day}. Where is it now?",
            "Can you change the delivery address of shipment {ref} to {street}, {city}?",
            "Shipment {ref} shows 'held at customs' since {day}. What do I need to send you?",
            "Please confirm the pickup of {count} pallets at our warehouse in {city} on {day}.",
            "The driver left parcel {ref} at the wrong door in {city}. How do I file a claim?",
        ],
    ),
    "policy-desk": (
        "You answer Alpmatt employees' questions on internal rules, citing the rule's name.",
        [
            "How many days of home office per week does the remote work rule allow for {team}?",
            "What is the approval limit for purchases of CHF {amount} in the {team} team?",
            "Do I need a second signature for a supplier contract over CHF {amount}?",
            "How do I report an expense of CHF {amount} for a trip to {city}?",
            "Which training is mandatory before driving a forklift in the {city} depot?",
        ],
    ),
    "code-review": (
        "You review Python code for Alpmatt's platform team. Be concrete and short.",
        [
            "Review this function:\n\ndef {name}(items):\n    total = 0\n    for i in "
            "range(len(items)):\n        total = total + items[i].{field}\n    return total",
            "Is this safe?\n\nquery = \"SELECT * FROM shipments WHERE ref = '\" + {field} + "
            "\"'\"\ncursor.execute(query)",
            "Suggest a better name and a docstring:\n\ndef {name}(x, y):\n    return "
            "[s for s in x if s.{field} in y]",
            "Why does this fail for an empty list?\n\ndef {name}(rows):\n    return "
            "sum(r.{field} for r in rows) / len(rows)",
        ],
    ),
    "delivery-extract": (
        "Extract the delivery note into JSON with keys ref, city, date, pallets. JSON only.",
        [
            "Delivery note {ref}: {count} pallets delivered to {street}, {city} on {day}.",
            "Lieferschein {ref} - {count} Paletten, Empfänger {street}, {city}, Datum {day}.",
            "Bon de livraison {ref}: {count} palettes livrées à {city} ({street}) le {day}.",
        ],
    ),
}
CITIES = ["Zürich", "Basel", "Bern", "Lausanne", "Lugano", "St. Gallen", "Luzern", "Chur"]
STREETS = ["Bahnhofstrasse 12", "Industriestrasse 4", "Seeweg 31", "Hauptgasse 7", "Lagerweg 2"]
DAYS = ["3 March", "14 April", "21 May", "9 June", "30 September", "12 November"]
TEAMS = ["finance", "dispatch", "warehouse", "IT", "sales"]
NAMES = ["total_weight", "sum_fees", "pallet_count", "late_shipments", "route_cost"]
FIELDS = ["weight", "fee", "pallets", "delay", "cost"]


def company_requests(count: int, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """``count`` (application, chat request body) pairs, the applications in turn, each body's
    slots drawn from ``seed``; the ``user`` is one of 40 employees."""
    draw = random.Random(seed)
    apps = list(APPS)
    requests = []
    for index in range(count):
        app = apps[index % len(apps)]
        system, templates = APPS[app]
        text = draw.choice(templates).format(
            ref=f"AL-{draw.randrange(100000, 999999)}",
            city=draw.choice(CITIES),
            street=draw.choice(STREETS),
            day=draw.choice(DAYS),
            count=draw.randrange(1, 40),
            amount=draw.choice([500, 2000, 5000, 20000, 100000]),
            team=draw.choice(TEAMS),
            name=draw.choice(NAMES),
            field=draw.choice(FIELDS),
        )
        body = {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
            "user": f"employee-{draw.randrange(40):02d}",
        }
        requests.append((app, body))
    return requests


def configuration(data_dir: Path, target: Path, heads: Path | None) -> dict[str, Any]:
    """The gateway's configuration for the company: content stored, the demo target, and the
    Medusa heads it serves with before retraining (if any)."""
    config: dict[str, Any] = {
        "data_dir": str(data_dir),
        "target": str(target),
        "store_content": True,
        "log_level": "warning",
    }
    if heads is not None:
        config |= {"heads": str(heads), "method": "medusa"}
    return config


def record(
    data_dir: Path, target: Path, heads: Path | None, count: int, seed: int,
    max_tokens: int = 48, clients: int = 8,
) -> Path:
    """Serve the company's gateway, send its requests under each application's key from
    ``clients`` threads, and return the configuration file ``specgate tune`` reads."""
    from bench.gateway_overhead import serving
    from gateway.settings import load_settings

    data_dir.mkdir(parents=True, exist_ok=True)
    config_path = data_dir / "gateway.yaml"
    config_path.write_text(yaml.safe_dump(configuration(data_dir, target, heads)))
    settings = load_settings(config_path)
    with serving(settings) as (url, services):
        keys = {app: services.keys.create("app", app, "company")[1] for app in APPS}
        model = services.backend.card.model_name
        with httpx.Client(base_url=url, timeout=600) as client:

            def send(request: tuple[str, dict[str, Any]]) -> None:
                app, body = request
                response = client.post(
                    "/v1/chat/completions",
                    json={**body, "model": model, "max_tokens": max_tokens, "temperature": 0},
                    headers={"authorization": f"Bearer {keys[app]}"},
                )
                response.raise_for_status()

            with ThreadPoolExecutor(clients) as pool:
                list(pool.map(send, company_requests(count, seed)))
    return config_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--target", type=Path, default=None, help="default: the demo target")
    parser.add_argument("--heads", type=Path, default=None, help="Medusa heads served before")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    from engine.training.demo.paths import default_demo_dir

    target = args.target or default_demo_dir() / "target"
    config = record(
        args.data_dir, target, args.heads, args.requests, args.seed, args.max_tokens, args.clients
    )
    print(config)


if __name__ == "__main__":
    main()
