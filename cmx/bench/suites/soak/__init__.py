"""Suite "soak" (``soak``): ``cmx serve`` under streamed OpenAI traffic (``soak_traffic``) while
actors and replicas are killed (``soak_faults``), judged from what it recorded
(``soak_figures``)."""
