from smcspec.bench.constrained import contenders, fits_schema


def test_schema_check():
    assert fits_schema('{"name": "Ada", "age": 36, "languages": ["Python", "C"]}')
    assert fits_schema('Sure:\n```json\n{"name": "A", "age": 3, "languages": []}\n```')
    assert not fits_schema('{"name": "Ada", "age": "36", "languages": []}')  # age a string
    assert not fits_schema('{"name": "Ada", "age": true, "languages": []}')
    assert not fits_schema('{"name": "Ada", "age": 36}')  # a key missing
    assert not fits_schema('{"name": "Ada", "age": 36, "languages": [], "x": 1}')
    assert not fits_schema("{name: Ada}")


def test_the_four_contenders():
    labels = [label for label, _, _ in contenders(4, 4)]
    assert labels == ["ar", "ar masked", "smc N=4 K=4", "smc N=4 K=4 constrained"]
