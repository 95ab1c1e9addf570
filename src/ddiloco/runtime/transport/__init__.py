"""Wire formats and the channels they travel on: frames and error codes (``wire``), the
data port for fragment pushes and fetches (``bulk``), the shared-secret token and TLS
(``auth``), and the model spec both sides build fragments from (``spec``)."""
