"""Caption readers and image-grouped splits, on small files generated per test."""
import json

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from clip_mini.data.readers import DataError, read_captions
from clip_mini.data.splits import split_by_image


def _images(folder, names):
    folder.mkdir(parents=True, exist_ok=True)
    for n in names:
        (folder / n).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (200, 10, 10)).save(folder / n)


def test_csv_default_columns_ids_and_stripping(tmp_path):
    _images(tmp_path / "images", ["b.png", "a.png"])
    (tmp_path / "captions.csv").write_text('image,caption\nb.png,  "a cat, sitting"\na.png,a dog\nb.png,x\n')
    df, skipped = read_captions(tmp_path / "captions.csv")
    assert list(df.columns) == ["path", "image", "caption", "image_id"]
    assert df["image"].tolist() == ["b.png", "a.png", "b.png"]
    assert df["caption"].tolist() == ["a cat, sitting", "a dog", "x"]
    assert df["image_id"].tolist() == [0, 1, 0]          # dense, first-appearance order
    assert df["path"][1] == str(tmp_path / "images" / "a.png")   # images/ subfolder found automatically
    assert skipped == []


def test_csv_custom_separator_and_columns(tmp_path):
    _images(tmp_path, ["x.png"])
    (tmp_path / "c.txt").write_text("file;text;extra\nx.png;hello there;1\n")
    df, _ = read_captions(tmp_path / "c.txt", sep=";", image_col="file", caption_col="text")
    assert df["caption"].tolist() == ["hello there"] and df["path"][0] == str(tmp_path / "x.png")


def test_tsv_by_extension_and_explicit_root(tmp_path):
    _images(tmp_path / "pics", ["x.png"])
    (tmp_path / "c.tsv").write_text("image\tcaption\nx.png\ta, b, c\n")
    df, _ = read_captions(tmp_path / "c.tsv", image_root=tmp_path / "pics")
    assert df["caption"][0] == "a, b, c" and df["path"][0] == str(tmp_path / "pics" / "x.png")


def test_flickr8k_token_file(tmp_path):
    _images(tmp_path / "Images", ["1.jpg", "2.jpg"])
    (tmp_path / "Flickr8k.token.txt").write_text("1.jpg#0\tA dog .\n1.jpg#1\tA brown dog .\n\n2.jpg#0\tA cat .\n")
    df, _ = read_captions(tmp_path / "Flickr8k.token.txt")
    assert df["image"].tolist() == ["1.jpg", "1.jpg", "2.jpg"]
    assert df["image_id"].tolist() == [0, 0, 1]
    assert df["path"][2] == str(tmp_path / "Images" / "2.jpg")


def test_flickr8k_bad_line_names_file_and_line(tmp_path):
    (tmp_path / "t.txt").write_text("1.jpg#0\tA dog .\nno tab here\n")
    with pytest.raises(DataError, match=r"t\.txt: line 2"):
        read_captions(tmp_path / "t.txt", fmt="flickr8k")


def test_coco_json(tmp_path):
    _images(tmp_path / "train2014", ["a.jpg", "b.jpg"])
    coco = {"images": [{"id": 7, "file_name": "train2014/a.jpg"}, {"id": 3, "file_name": "train2014/b.jpg"}],
            "annotations": [{"image_id": 3, "caption": "two"}, {"image_id": 7, "caption": "one"},
                            {"image_id": 3, "caption": "again"}]}
    (tmp_path / "captions_train.json").write_text(json.dumps(coco))
    df, _ = read_captions(tmp_path / "captions_train.json")
    assert df["image"].tolist() == ["train2014/b.jpg", "train2014/a.jpg", "train2014/b.jpg"]
    assert df["image_id"].tolist() == [0, 1, 0]


@pytest.mark.parametrize("coco, match", [
    ({"images": []}, "annotations"),
    ({"images": [{"id": 1}], "annotations": []}, r"images\[0\]"),
    ({"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": [{"image_id": 2, "caption": "x"}]},
     r"annotations\[0\] refers to image_id 2"),
    # Found by tests/test_fuzz.py: unhashable ids crashed with TypeError, other types became names silently.
    ({"images": [{"id": [1], "file_name": "a.jpg"}], "annotations": []}, r"images\[0\]\.id must be an integer"),
    ({"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": [{"image_id": {"a": 1}, "caption": "x"}]},
     r"annotations\[0\]\.image_id must be an integer"),
    ({"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": [{"image_id": True, "caption": "x"}]},
     r"annotations\[0\]\.image_id must be an integer"),
    ({"images": [{"id": 1, "file_name": {"x": 1}}], "annotations": []}, r"images\[0\]\.file_name must be a string"),
    ({"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": [{"image_id": 1, "caption": ["x"]}]},
     r"annotations\[0\]\.caption must be a string"),
])
def test_coco_errors_name_the_field(tmp_path, coco, match):
    (tmp_path / "c.json").write_text(json.dumps(coco))
    with pytest.raises(DataError, match=match):
        read_captions(tmp_path / "c.json")


@pytest.mark.parametrize("name", ["../secret.png", "sub/../../secret.png", "/etc/passwd"])
def test_paths_escaping_the_root_are_refused(tmp_path, name):
    (tmp_path / "c.csv").write_text(f"image,caption\nok.png,fine\n{name},evil\n")
    with pytest.raises(DataError, match=r"c\.csv: row 2: image path .* is outside the image root"):
        read_captions(tmp_path / "c.csv", image_root=tmp_path)


@pytest.mark.parametrize("name", [".", "sub/..", "./"])
def test_a_name_that_is_the_root_itself_is_refused(tmp_path, name):
    # Found by tests/test_fuzz.py: "." resolved to the image folder and passed as an image path.
    (tmp_path / "c.csv").write_text(f"image,caption\nok.png,fine\n{name},odd\n")
    with pytest.raises(DataError, match=r"c\.csv: row 2: image path .* is the image root itself"):
        read_captions(tmp_path / "c.csv", image_root=tmp_path)


def test_image_name_with_a_nul_byte_names_the_row(tmp_path):
    # Found by tests/test_fuzz.py: os.stat raised ValueError ("embedded null byte") from the image check.
    (tmp_path / "c.csv").write_bytes(b"image,caption\nok.png,fine\nb\x00d.png,odd\n")
    with pytest.raises(DataError, match=r"c\.csv: row 2: image name .* contains a NUL byte"):
        read_captions(tmp_path / "c.csv")


def test_over_long_image_name_is_a_missing_file_not_a_crash(tmp_path):
    # Found by tests/test_fuzz.py: guessing the image root stat-ed a 300-byte name and pathlib raised ENAMETOOLONG.
    long_name = "n" * 300 + ".png"
    _images(tmp_path, ["ok.png"])
    (tmp_path / "c.csv").write_text(f"image,caption\nok.png,fine\n{long_name},long\n")
    df, _ = read_captions(tmp_path / "c.csv")
    assert df["image"].tolist() == ["ok.png", long_name]
    from clip_mini.data.images import check_images

    assert "cannot read" in check_images(df["path"])[str(tmp_path / long_name)]


def test_absolute_path_inside_root_is_allowed(tmp_path):
    _images(tmp_path, ["in.png"])
    (tmp_path / "c.csv").write_text(f"image,caption\n{tmp_path / 'in.png'},fine\nsub/../in.png,also\n")
    df, _ = read_captions(tmp_path / "c.csv", image_root=tmp_path)
    assert df["path"].nunique() == 1 and df["image_id"].tolist() == [0, 0]


def test_missing_columns_name_file_and_columns(tmp_path):
    (tmp_path / "c.csv").write_text("filename,text\na.png,x\n")
    with pytest.raises(DataError, match=r"c\.csv: missing column\(s\) \['image', 'caption'\]"):
        read_captions(tmp_path / "c.csv")


@pytest.mark.parametrize("content, match", [("", "file is empty"), ("image,caption\n", "header only, no rows")])
def test_empty_files(tmp_path, content, match):
    (tmp_path / "c.csv").write_text(content)
    with pytest.raises(DataError, match=match):
        read_captions(tmp_path / "c.csv")


def test_bad_encoding_names_the_line(tmp_path):
    (tmp_path / "c.csv").write_bytes(b"image,caption\na.png,fine\nb.png,caf\xe9 latin-1\n")
    with pytest.raises(DataError, match=r"c\.csv: line 3: not valid UTF-8"):
        read_captions(tmp_path / "c.csv")


def test_empty_captions_are_skipped_with_report(tmp_path):
    _images(tmp_path, ["a.png"])
    (tmp_path / "c.csv").write_text('image,caption\na.png,one\na.png,"  "\na.png,\n,orphan\na.png\n')
    df, skipped = read_captions(tmp_path / "c.csv")
    assert df["caption"].tolist() == ["one"]
    items = [s[0] for s in skipped]
    assert items == [f"{tmp_path / 'c.csv'}:row {r}" for r in (2, 3, 4, 5)]
    assert "empty caption" in skipped[0][1] and skipped[2][1] == "empty image name"


def test_only_empty_captions_is_an_error(tmp_path):
    (tmp_path / "c.csv").write_text("image,caption\na.png,\n")
    with pytest.raises(DataError, match="no usable rows"):
        read_captions(tmp_path / "c.csv")


def test_missing_captions_file(tmp_path):
    with pytest.raises(DataError, match="captions file not found"):
        read_captions(tmp_path / "nope.csv")


# --- splits -------------------------------------------------------------------------------------------------

def _table(n_images=50, per_image=5):
    rows = [(f"/d/{i:03d}.jpg", f"{i:03d}.jpg", f"caption {j} of {i}")
            for i in range(n_images) for j in range(per_image)]
    df = pd.DataFrame(rows, columns=["path", "image", "caption"])
    df["image_id"] = pd.factorize(df["path"])[0]
    return df


def test_split_is_disjoint_complete_and_grouped():
    df = _table()
    s = split_by_image(df, val=0.2, test=5, seed=1)
    sets = {k: set(v["path"]) for k, v in s.items()}
    assert len(sets["val"]) == 10 and len(sets["test"]) == 5 and len(sets["train"]) == 35
    assert not (sets["train"] & sets["val"] or sets["train"] & sets["test"] or sets["val"] & sets["test"])
    assert sum(len(v) for v in s.values()) == len(df)          # every caption kept, with its image
    for part in s.values():
        assert part["image_id"].tolist() == pd.factorize(part["path"])[0].tolist()   # re-densified per split
        assert (part.groupby("path").size() == 5).all()


def test_split_is_deterministic_by_seed_and_row_order():
    df = _table()
    a = split_by_image(df, val=0.2, seed=3)["val"]
    b = split_by_image(df.sample(frac=1.0, random_state=0), val=0.2, seed=3)["val"]
    c = split_by_image(df, val=0.2, seed=4)["val"]
    assert set(a["path"]) == set(b["path"])
    assert set(a["path"]) != set(c["path"])


def test_split_lists_match_names_and_basenames(tmp_path):
    df = _table(10)
    df["image"] = "sub/" + df["image"]     # the list may use bare names, as Flickr8k split files do
    (tmp_path / "val.txt").write_text("# dev images\nsub/000.jpg\n001.jpg\n\nnot_there.jpg\n")
    s = split_by_image(df, val=0.5, test=2, val_list=tmp_path / "val.txt", seed=0)
    assert set(s["val"]["image"]) == {"sub/000.jpg", "sub/001.jpg"}
    assert s["test"]["path"].nunique() == 2 and s["train"]["path"].nunique() == 6


def test_split_list_errors():
    df = _table(10)
    with pytest.raises(DataError, match="in both val_list and test_list"):
        split_by_image(df, val_list=["000.jpg"], test_list=["000.jpg"])
    with pytest.raises(DataError, match="none of its 1 names"):
        split_by_image(df, val_list=["zzz.jpg"])
    with pytest.raises(DataError, match="no training images|would take all"):
        split_by_image(df, val=5, test=5)


def test_split_counts_print_as_integers_and_say_the_fix():
    df = _table(2)
    with pytest.raises(DataError) as err:
        split_by_image(df, val=300.0)   # a config value: YAML and --set give floats
    assert "val split of 300 images would take all 2 images" in str(err.value)
    assert "300.0" not in str(err.value) and "smaller data.val" in str(err.value) and "at most 1" in str(err.value)
    with pytest.raises(DataError, match=r"data\.test=2\.5 is neither a fraction .* nor a whole count"):
        split_by_image(df, val=0, test=2.5)
    with pytest.raises(DataError, match=r"data\.val=1, data\.test=1, 2 images\); use a smaller data\.val"):
        split_by_image(df, val=1.0, test=1.0)
    with pytest.raises(DataError, match="data.val must be >= 0"):
        split_by_image(df, val=float("nan"))


def test_split_zero_val_gives_empty_frames():
    s = split_by_image(_table(4), val=0, test=0)
    assert len(s["val"]) == 0 and len(s["test"]) == 0 and len(s["train"]) == 20
    assert list(s["val"].columns) == ["path", "image", "caption", "image_id"]
    assert np.array_equal(s["train"]["image_id"].unique(), np.arange(4))


def test_row_with_extra_fields_is_an_error_not_a_shift(tmp_path):
    (tmp_path / "c.csv").write_text("image,caption\na.png,fine\nb.png,a dog, running\n")
    with pytest.raises(DataError, match=r"c\.csv: row 2 \(line 3\): 3 fields but the header has 2"):
        read_captions(tmp_path / "c.csv")


def test_multiline_quoted_caption(tmp_path):
    _images(tmp_path, ["a.png"])
    (tmp_path / "c.csv").write_text('image,caption\na.png,"two\nlines ""quoted"""\n')
    df, _ = read_captions(tmp_path / "c.csv")
    assert df["caption"].tolist() == ['two\nlines "quoted"']


def test_unterminated_quote_is_an_error(tmp_path):
    (tmp_path / "c.csv").write_text('image,caption\na.png,"never closed\nb.png,x\n')
    with pytest.raises(DataError, match=r"c\.csv: line \d+: cannot parse"):
        read_captions(tmp_path / "c.csv")
