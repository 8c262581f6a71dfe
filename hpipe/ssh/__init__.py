"""hpipe's SSH layer: connections with strict host keys, the host probe, remote workers that cannot
outlive their launcher, and file transfer over SFTP. Used by `hpipe launch --cluster`,
`hpipe cluster check` and `hpipe profile --cluster`.

`remote_wrapper.py` and `host_probe.py` are not imported on the hosts: their source travels with
each remote command and runs there with the host's own interpreter (stdlib only).
"""

from hpipe.ssh.connect import (Connection, RemoteProcess, connect, connect_all, fingerprint, get_file, host_label,
                               host_problems, known_hosts_path, local_versions, probe, put_files, run_python,
                               write_files)
from hpipe.ssh.host_probe import sha256

__all__ = ["Connection", "RemoteProcess", "connect", "connect_all", "fingerprint", "get_file", "host_label",
           "host_problems", "known_hosts_path", "local_versions", "probe", "put_files", "run_python", "sha256",
           "write_files"]
