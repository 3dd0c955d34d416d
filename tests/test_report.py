"""Pictures of a run: snrt train writes RUN/metrics.png; snrt report redraws it for one run or
several and prints a table; a folder that is not a run is one clear line."""

import json
import os

import pytest

from snrt.cli import main

PNG = b"\x89PNG"


def train(folder, *flags):
    assert main(["train", "configs/lenet.yaml", "--iterations", "3", "--batch", "8", "--out", str(folder),
                 "--no-progress", *flags]) == 0


def test_a_run_draws_its_metrics_and_records_how_long_it_waited_for_data(tmp_path):
    train(tmp_path / "run")
    assert (tmp_path / "run" / "metrics.png").read_bytes()[:4] == PNG
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in lines] == [0, 1, 2]
    assert all(m["data_wait_s"] >= 0 for m in lines)


def test_report_redraws_one_run_and_tables_several_side_by_side(tmp_path, capsys):
    train(tmp_path / "a")
    train(tmp_path / "b", "--precision", "bf16")
    (tmp_path / "a" / "metrics.png").unlink()
    capsys.readouterr()
    assert main(["report", str(tmp_path / "a"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    last = json.loads((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[-1])
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    (row,) = report["runs"]
    assert row["run"] == "a" and row["iterations"] == 3 and row["final_loss"] == last["loss"]
    assert row["heldout_accuracy"] == summary["heldout_accuracy"]
    assert (tmp_path / "a" / "metrics.png").read_bytes()[:4] == PNG
    both = tmp_path / "both.png"
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--png", str(both)]) == 0
    out = capsys.readouterr().out
    assert "a" in out and "b" in out and both.read_bytes()[:4] == PNG


def test_report_says_in_one_line_what_is_wrong(tmp_path, capsys):
    train(tmp_path / "run")
    capsys.readouterr()
    assert main(["report", str(tmp_path / "run"), str(tmp_path / "run")]) == 2
    assert "several runs are drawn into one picture: name it with --png FILE" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{tmp_path / 'empty'}: not a run folder: no metrics.jsonl" in err and "Traceback" not in err
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
        f.write("{not json\n")
    assert main(["report", str(tmp_path / "run")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{tmp_path / 'run' / 'metrics.jsonl'}: line 4 is not JSON" in err


def test_eval_every_records_held_out_results_without_changing_the_training(tmp_path):
    import snrt
    from snrt.train import Trainer

    def run(every):
        config = snrt.load_config("configs/lenet.yaml", {"train.batch": 8, "train.eval_every": every})
        return Trainer(config).fit(iterations=6)
    plain, evaluated = run(0), run(2)
    assert [m.loss for m in plain] == [m.loss for m in evaluated]
    assert [m.heldout_accuracy is not None for m in evaluated] == [False, True, False, True, False, False]
    assert all(0 <= m.heldout_accuracy <= 1 for m in evaluated if m.heldout_accuracy is not None)
    assert all(m.heldout_accuracy is None for m in plain)


def test_a_figure_interrupted_while_it_is_written_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pytest

    from snrt.atomic import save_figure

    path = tmp_path / "metrics.png"
    fig = plt.figure()
    save_figure(fig, path)
    earlier = path.read_bytes()
    assert earlier.startswith(b"\x89PNG") and len(earlier) > 1000

    def interrupted(target, **kwargs):
        target.write_bytes(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(fig, "savefig", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_figure(fig, path)
    plt.close(fig)
    assert path.read_bytes() == earlier
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.png"]  # no temporary left


def test_a_file_that_cannot_be_written_is_named_as_asked_not_by_its_temporary(tmp_path):
    import pytest

    from snrt.atomic import replace_atomically

    path = tmp_path / "missing" / "timeline.png"
    with pytest.raises(FileNotFoundError) as raised:
        replace_atomically(path, lambda partial: partial.write_bytes(b"x"))
    assert raised.value.filename == str(path)


def metrics_folder(folder, text):
    """A run folder of metrics.jsonl `text` alone, as a run leaves it before its summary."""
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(text)
    return folder


LINES = "".join(json.dumps({"iteration": i, "loss": 2.0 - i}) + "\n" for i in range(3))


def test_report_draws_a_run_killed_while_it_wrote_a_line(tmp_path, capsys):
    run = metrics_folder(tmp_path / "run", LINES + '{"iteration": 3, "lo')
    assert main(["report", str(run), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["runs"]
    assert row["iterations"] == 3 and row["final_loss"] == 0.0
    (run / "metrics.jsonl").write_text(LINES + '{"iteration": 3, "lo\n' + LINES)  # a whole line: damaged
    assert main(["report", str(run)]) == 2
    assert "metrics.jsonl: line 4 is not JSON" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("damage, says", [
    (lambda run: (run / "metrics.jsonl").write_bytes(LINES.encode() + b"\xff\xfe\n"), "metrics.jsonl: not a text file"),
    (lambda run: (run / "summary.json").write_bytes(b"\xff"), "summary.json: not a text file"),
    (lambda run: (run / "metrics.jsonl").write_text('{"iteration": 0, "loss": null}\n'),
     "metrics.jsonl: line 1 is not a metrics record"),
    (lambda run: None, "m.txt: cannot draw a picture as .txt; name it .png"),
], ids=["metrics", "summary", "loss", "picture"])
def test_a_damaged_run_or_a_picture_of_no_known_format_is_one_line(tmp_path, capsys, damage, says):
    run = metrics_folder(tmp_path / "run", LINES)
    damage(run)
    assert main(["report", str(run), "--png", str(tmp_path / "m.txt")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert says in err and "Traceback" not in err


def test_a_run_in_a_folder_whose_name_is_not_utf8_is_drawn(tmp_path, capsys):
    latin1 = os.fsdecode(b"caf\xe9")  # byte 0xE9 is not UTF-8
    (tmp_path / "x").mkdir()
    for run in (metrics_folder(tmp_path / latin1, LINES), metrics_folder(tmp_path / "x" / latin1, LINES)):
        assert main(["report", str(run), "--json"]) == 0 and (run / "metrics.png").read_bytes()[:4] == PNG
    assert main(["report", str(tmp_path / latin1), str(tmp_path / "x" / latin1), "--png",
                 str(tmp_path / "both.png"), "--json"]) == 0  # the same name twice: told apart by their paths
    assert (tmp_path / "both.png").read_bytes()[:4] == PNG


def test_a_summary_whose_heldout_accuracy_is_not_a_number_shows_none(tmp_path, capsys):
    run = metrics_folder(tmp_path / "run", LINES)
    (run / "summary.json").write_text('{"heldout_accuracy": "0.9"}')  # edited by hand
    assert main(["report", str(run)]) == 0
    capsys.readouterr()
    assert main(["report", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["heldout_accuracy"] is None


def test_values_beside_the_loss_that_are_not_numbers_show_none(tmp_path, capsys):
    big = "1" + "0" * 400  # an int no float holds
    run = metrics_folder(tmp_path / "run", LINES + json.dumps({"iteration": 3, "loss": 0.5, "accuracy": [1]})[:-1]
                         + f', "images_per_s": {big}, "data_wait_s": true, "peak_device_bytes": "lots"}}\n')
    assert main(["report", str(run)]) == 0 and (run / "metrics.png").read_bytes()[:4] == PNG
    capsys.readouterr()
    assert main(["report", str(run), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["runs"]
    assert row["peak_device_bytes"] is None and row["images_per_s"] is None and row["data_wait_s"] is None
    assert row["iterations"] == 4 and row["final_loss"] == 0.5


@pytest.mark.parametrize("record", [{"iteration": True, "loss": 1.0}, {"iteration": -1, "loss": 1.0},
                                    {"iteration": int("1" + "0" * 400), "loss": 1.0},
                                    {"iteration": 0, "loss": int("1" + "0" * 400)}])
def test_an_iteration_or_loss_no_float_holds_is_one_line(tmp_path, capsys, record):
    run = metrics_folder(tmp_path / "run", json.dumps(record) + "\n")
    assert main(["report", str(run)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "metrics.jsonl: line 1 is not a metrics record" in err and "Traceback" not in err
