"""Prisoner's dilemma: a warden and two prisoners across five phases, each extending its cache.

The multi-phase scenario of the kvactors paper. Every phase appends to each
agent's conversation instead of rebuilding a prompt, so each agent's KV cache
is its working memory: a phase prefills only its new messages on top of the
cached prefix. The permanent agents (warden, marco, danny) start cold, stay
hot, and after the night (the Runtime stops and a new one starts over the same
--cache-dir, as after a process restart) resume warm from disk. The analyst
only appears in phase 5, cold.

    1 interrogation   the warden makes each prisoner the offer, separately
    2 the yard        marco talks to danny
    3 decision        each prisoner says CONFESS or SILENT
      (night: the process restarts)
    4 verdict         the warden hears both decisions and sentences them
    5 reckoning       the prisoners hear the verdict; an analyst reviews the case

    python examples/prisoners_dilemma.py
    python examples/prisoners_dilemma.py --model mlx-community/Llama-3.2-3B-Instruct-4bit

With no --model the embedded SmolLM2-135M-Instruct runs; `--model tiny` runs a
random-weight model (fast, but the text is nonsense).
"""


from common import cache_dir_of, example_parser
from runtime import Runtime
from runtime.tiny import is_tiny_model

SENTENCES = {("SILENT", "SILENT"): (1, 1), ("SILENT", "CONFESS"): (10, 0),
             ("CONFESS", "SILENT"): (0, 10), ("CONFESS", "CONFESS"): (5, 5)}
OFFER = ("If you confess and your partner stays silent, you walk free and they get 10 years. "
         "If you both stay silent, 1 year each. If you both confess, 5 years each.")
AGENTS = {
    "warden": f"You are the warden of a prison. Two prisoners, Marco and Danny, robbed a bank together. {OFFER}",
    "marco": "You are Marco, arrested with your partner Danny. Protect yourself, but you owe Danny.",
    "danny": "You are Danny, arrested with your partner Marco. You do not fully trust Marco.",
}


def spawn_all(rt):
    return {name: rt.spawn(name, system=system) for name, system in AGENTS.items()}


def decision(text):
    """The first of CONFESS / SILENT in the answer (SILENT if neither)."""
    t = text.upper()
    c, s = t.find("CONFESS"), t.find("SILENT")
    return "CONFESS" if c >= 0 and (s < 0 or c < s) else "SILENT"


def main():
    parser = example_parser(__doc__, 64)
    args = parser.parse_args()
    cache_dir = cache_dir_of(args, "prisoners")
    opts = dict(max_tokens=args.max_tokens, timeout=120)

    def turn(reply):
        t = reply.timings
        print(f"  {reply.agent:<7} {reply.cache:<4}  ttft {t.ttft_s * 1000:6.1f} ms  "
              f"prefill {t.prefill_tokens:4d} tok  {reply.text.strip()[:50]!r}")
        return reply

    def message(a, sender, to, text):  # `to` answers; the answer also lands in the sender's history
        return turn(a[sender].send_to(a[to], text, **opts).get(timeout=120))

    with Runtime(model=args.model, cache_dir=cache_dir) as rt:
        a = spawn_all(rt)
        print("Phase 1: interrogation")
        offer = turn(a["warden"].ask("Phase 1: interrogation. Make each prisoner your offer.", **opts))
        for p in ("marco", "danny"):
            message(a, "warden", p, f"Phase 1: interrogation. {offer.text or OFFER}")

        print("Phase 2: the yard")
        pitch = turn(a["marco"].ask("Phase 2: the yard. You meet Danny. What do you tell him?", **opts))
        message(a, "marco", "danny", f"Phase 2: the yard. {pitch.text or '...'}")

        print("Phase 3: decision")
        said = {p: turn(a[p].ask("Phase 3: decision. Answer CONFESS or SILENT, then say why.", **opts))
                for p in ("marco", "danny")}
    print("  (night falls: the runtime stops; a new one starts over the same cache dir)")

    with Runtime(model=args.model, cache_dir=cache_dir) as rt:
        a = spawn_all(rt)  # the same names: history and cache come back from disk
        print("Phase 4: verdict")
        choice = {p: decision(r.text) for p, r in said.items()}
        years = SENTENCES[choice["marco"], choice["danny"]]
        verdict = turn(a["warden"].ask(
            f"Phase 4: verdict. Marco chose {choice['marco']}, Danny chose {choice['danny']}. "
            f"By your offer Marco gets {years[0]} years and Danny {years[1]}. Announce it.", **opts))

        print("Phase 5: reckoning")
        for p in ("marco", "danny"):
            message(a, "warden", p, f"Phase 5: reckoning. {verdict.text or 'The verdict is in.'}")
        analyst = rt.spawn("analyst", system="You are a game theorist. Be brief.")
        turn(analyst.ask(f"Marco chose {choice['marco']} and Danny chose {choice['danny']} after talking "
                         f"in the yard. Was that rational? {OFFER}", **opts))

    print(f"\nMarco {choice['marco']}, Danny {choice['danny']}: {years[0]} and {years[1]} years")
    if is_tiny_model(rt.spec.model_id):
        print("(tiny model: random weights, so the text is nonsense)")


if __name__ == "__main__":
    main()
