"""What the suites of ``cmx bench`` share; nothing here imports a suite.

    core       figures, goals (judged by the far end of a ratio's interval, only on figures
               that can be judged), settings, timing, cold caches
    intervals  two variants alternated per repetition; bootstrap intervals of a ratio of
               medians, resampled in pairs or each side on its own
    baselines  the machine's own limits beside a suite's figures: fio O_DIRECT jobs, memcpy on
               one thread and on as many as the stores copy with
    payloads   keys and random payloads for the suites that drive a store directly
    machine    CPU, cores, memory, disk and kernel, for every report
    cluster    a local multi-node Ray cluster with the service on it, and a prefix stored there
    hosts      Ray nodes on hosts that share nothing but a TCP network (host_net: the
               namespaces under them)
    proc_cpu   the CPU-seconds each group of processes took while something ran
    runner     runs suites in order (``cmx.bench.suites.SUITES``) and collects a BenchReport
    report     JSON, markdown, plots, the suites' sections of docs/BENCHMARKS.md
    summary    the counts of PASS, MISS and inconclusive atop docs/BENCHMARKS.md, from its
               sections
    render     a suite's figures as a table on the command line
"""
