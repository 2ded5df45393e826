"""The ground every other package stands on, importable without torch: seed streams (:mod:`~dqsgd.core.rng`),
the shard split (:mod:`~dqsgd.core.sharding`), wait limits (:mod:`~dqsgd.core.timeouts`), the command line's
exceptions (:mod:`~dqsgd.core.errors`), the TOML config layer (:mod:`~dqsgd.core.config_file`), lazy
package exports (:mod:`~dqsgd.core.lazy`) and optional dependencies (:mod:`~dqsgd.core.extras`).

Nothing is imported here: each module is loaded when it is named.
"""
