-- The store keeps each value as it was written, and search folds accents.
--
-- value_json becomes TEXT: a value comes back byte for byte as written (key order, spacing),
-- as on SQLite; JSONB would hand back its own normal form. The JSON path filter of a search
-- reads it as JSONB when it runs (search_store).
--
-- store_fold takes the diacritics off Latin letters (é -> e, Å -> A, ...), as SQLite's FTS5
-- tokenizer does by default (unicode61, remove_diacritics): "creme brulee" finds "Crème
-- Brûlée". A translate() table rather than the unaccent extension, which not every
-- PostgreSQL has and which is not IMMUTABLE.

CREATE FUNCTION store_fold(document text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT AS $$
    SELECT translate(
        document,
        'ÀÁÂÃÄÅÇÈÉÊËÌÍÎÏÑÒÓÔÕÖÙÚÛÜÝàáâãäåçèéêëìíîïñòóôõöùúûüýÿĀāĂăĄąĆćĈĉĊċČčĎďĒēĔĕĖėĘęĚěĜĝĞğĠġĢģĤĥĨĩĪīĬĭĮįİĴĵĶķĹĺĻļĽľŃńŅņŇňŌōŎŏŐőŔŕŖŗŘřŚśŜŝŞşŠšŢţŤťŨũŪūŬŭŮůŰűŲųŴŵŶŷŸŹźŻżŽžƠơƯưǍǎǏǐǑǒǓǔǕǖǗǘǙǚǛǜǞǟǠǡǦǧǨǩǪǫǬǭǰǴǵǸǹǺǻȀȁȂȃȄȅȆȇȈȉȊȋȌȍȎȏȐȑȒȓȔȕȖȗȘșȚțȞȟȦȧȨȩȪȫȬȭȮȯȰȱȲȳ',
        'AAAAAACEEEEIIIINOOOOOUUUUYaaaaaaceeeeiiiinooooouuuuyyAaAaAaCcCcCcCcDdEeEeEeEeEeGgGgGgGgHhIiIiIiIiIJjKkLlLlLlNnNnNnOoOoOoRrRrRrSsSsSsSsTtTtUuUuUuUuUuUuWwYyYZzZzZzOoUuAaIiOoUuUuUuUuUuAaAaGgKkOoOojGgNnAaAaAaEeEeIiIiOoOoRrRrUuUuSsTtHhAaEeOoOoOoOoYy'
    )
$$;

CREATE OR REPLACE FUNCTION store_words(document text) RETURNS tsvector
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT AS $$
    SELECT to_tsvector(
        'simple',
        translate(store_fold(document), '!"#$%&''()*+,-./:;<=>?@[\]^_`{|}~', repeat(' ', 32))
    )
$$;

CREATE OR REPLACE FUNCTION store_query(query text) RETURNS tsquery
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT AS $$
    SELECT websearch_to_tsquery(
        'simple',
        translate(store_fold(query), '!#$%&''()*+,-./:;<=>?@[\]^_`{|}~', repeat(' ', 31))
    )
$$;

DROP INDEX idx_store_search;
ALTER TABLE store DROP COLUMN search;
ALTER TABLE store ALTER COLUMN value_json TYPE TEXT USING value_json::text;
ALTER TABLE store ADD COLUMN search TSVECTOR GENERATED ALWAYS AS (
    store_words(namespace) || store_words(key) || store_words(value_json)
) STORED;
CREATE INDEX idx_store_search ON store USING gin (search);
