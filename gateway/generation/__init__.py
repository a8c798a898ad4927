"""One audited generation: the job built from a request (``job``), the audited run that
records its `request` and `completion` events (``audited``), and the answer it renders
(``replies``, ``stream``)."""
