"""python -m cvt.schemas: regenerate the JSON Schema files from the typed models."""

from cvt.schemas import write_schema_files

for p in write_schema_files():
    print(p)
