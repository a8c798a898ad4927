"""Outside the serving path: training Medusa and EAGLE heads, and building the demo pair."""
