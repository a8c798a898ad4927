"""What the gateway and any backend may use of the engine, without torch: the request and
result types, the delta channel, chat rendering, grammar text and tool-call parsing."""
