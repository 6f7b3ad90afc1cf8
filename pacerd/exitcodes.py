"""The exit statuses of the ``pacerd`` command, one per kind of failure.

A supervisor decides from the status alone whether restarting can help: the
permanent ones (usage, not migrated, config) are listed in the systemd unit's
``RestartPreventExitStatus=``; the rest may be retried. Values follow
sysexits.h, and the LSB init-script codes where sysexits has no fitting one;
``systemctl status`` names both families (``6/NOTCONFIGURED``, ``78/CONFIG``).
docs/operations.md lists them. Constants only: no imports, no I/O.

    status  name                 meaning                                   restart helps
    0       EX_OK                done; or the daemon stopped gracefully    -
    1       EX_FAILURE           any other error (the ledger refused the   maybe
                                 input, a migration failed, ...)
    2       EX_USAGE             bad command line                          no
    6       EX_NOT_MIGRATED      the ledger schema is older than this      no
                                 pacerd: run ``pacerd migrate``
    66      EX_UNKNOWN_JOB       the named job does not exist              -
    69      EX_UNAVAILABLE       PostgreSQL or RabbitMQ cannot be reached  yes
    78      EX_CONFIG            the configuration is invalid              no
    130     EX_INTERRUPTED       interrupted (Ctrl-C)                      -
"""

from __future__ import annotations

EX_OK = 0
EX_FAILURE = 1
EX_USAGE = 2  # argparse's own status for a bad command line
EX_NOT_MIGRATED = 6  # LSB "program is not configured"
EX_UNKNOWN_JOB = 66  # sysexits EX_NOINPUT: the input named does not exist
EX_UNAVAILABLE = 69  # sysexits: a service is unavailable
EX_CONFIG = 78  # sysexits: configuration error
EX_INTERRUPTED = 130  # 128 + SIGINT

PERMANENT = (EX_USAGE, EX_NOT_MIGRATED, EX_CONFIG)  # restarting cannot help
