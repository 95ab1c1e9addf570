"""mkdocs hooks (``hooks:`` in mkdocs.yml).

``docs/index.md`` is README.md (``--8<-- "README.md"``), whose links to the documentation
are relative to the repository's root (``docs/runtime.md``); on the site the page sits in
``docs/`` itself, so the hook includes the README with that prefix taken off its links
(``runtime.md``).
"""

from __future__ import annotations

import re
from pathlib import Path

_INCLUDE = '--8<-- "README.md"'
_DOC_LINK = re.compile(r"\]\(docs/")


def on_page_markdown(markdown: str, page, config, **kwargs) -> str:
    if page.file.src_uri != "index.md" or _INCLUDE not in markdown:
        return markdown
    readme = Path(config.config_file_path).parent / "README.md"
    return markdown.replace(_INCLUDE, _DOC_LINK.sub("](", readme.read_text(encoding="utf-8")))
