// Jobplane dashboard: live regions, local times, confirmations. No framework, no CDN.
(function () {
  "use strict";

  // <time data-local datetime="…">: show the viewer's local time on hover, and a local
  // date in elements marked data-local="full".
  function localise(root) {
    root.querySelectorAll("time[data-local]").forEach(function (el) {
      var when = new Date(el.getAttribute("datetime"));
      if (isNaN(when)) return;
      var local = when.toLocaleString(undefined, {
        year: "numeric", month: "short", day: "numeric",
        hour: "2-digit", minute: "2-digit", second: "2-digit", timeZoneName: "short"
      });
      if (el.getAttribute("data-local") === "full") el.textContent = local;
      el.title = local + " (your time) · " + el.title;
    });
  }

  // [data-live="/url"]: replaced every data-every ms by the server-rendered fragment at
  // that URL while the tab is visible. The fragment is escaped by the server's templates.
  function live(region) {
    var every = parseInt(region.getAttribute("data-every") || "3000", 10);
    var timer = null;
    // Not while the tab is hidden, a form in it has focus, or rows are selected (checked
    // again when the answer arrives: the user may have started meanwhile).
    function busy() {
      return document.hidden || region.querySelector("form :focus, input[type=checkbox]:checked");
    }
    function tick() {
      if (busy()) {
        schedule();
        return;
      }
      fetch(region.getAttribute("data-live"), {
        headers: { "X-Live": "1" }, credentials: "same-origin", cache: "no-store"
      }).then(function (response) {
        if (response.status === 401) {
          document.getElementById("offline").hidden = false;
          return null;
        }
        return response.ok ? response.text() : "";
      }).then(function (html) {
        if (html === null) return;
        if (busy()) {
          schedule();
          return;
        }
        if (html) {
          forget(region);
          region.innerHTML = html;
          localise(region);
          draw(region);
        }
        var stop = region.querySelector("[data-live-stop]");
        if (!stop) schedule();
      }).catch(schedule);
    }
    function schedule() { clearTimeout(timer); timer = setTimeout(tick, every); }
    if (!region.querySelector("[data-live-stop]")) schedule();
  }

  // <form data-confirm="…">: asks before submitting. <form data-confirm-selected="{action}
  // {n} …">: a bulk action on the checkboxes that belong to it (form="id"), with their count.
  document.addEventListener("submit", function (event) {
    var form = event.target;
    var message = form.getAttribute("data-confirm");
    if (message && !window.confirm(message)) event.preventDefault();
    var selected = form.getAttribute("data-confirm-selected");
    if (!selected) return;
    // (form.id would be the checkboxes named "id": a form's named elements shadow it)
    var n = document.querySelectorAll('input[form="' + form.getAttribute("id") + '"]:checked').length;
    var verb = event.submitter ? event.submitter.getAttribute("data-verb") : "Act on";
    if (n === 0) {
      window.alert("Select instances first.");
      event.preventDefault();
    } else if (!window.confirm(selected.replace("{action}", verb).replace("{n}", n))) {
      event.preventDefault();
    }
  });

  // The placeholder in every attribute under root, the rows of nested lists' templates too.
  function renumber(root, holder, next) {
    root.querySelectorAll("*").forEach(function (element) {
      Array.prototype.forEach.call(element.attributes, function (attribute) {
        if (attribute.value.indexOf(holder) !== -1) {
          attribute.value = attribute.value.split(holder).join(next);
        }
      });
      if (element.content) renumber(element.content, holder, next);
    });
  }

  // Generated argument forms: [data-add-row] copies the array's <template> row with the next
  // index in place of its placeholder, in the attributes only (names, ids, labels' targets:
  // a title or description is text as written); [data-remove-row] removes its row.
  document.addEventListener("click", function (event) {
    var add = event.target.closest("[data-add-row]");
    if (add) {
      var array = add.closest("[data-array]");
      var next = String(parseInt(array.getAttribute("data-next"), 10));
      var holder = array.getAttribute("data-placeholder");
      var template = array.querySelector(":scope > template");
      var row = template.content.cloneNode(true);
      renumber(row, holder, next);
      array.setAttribute("data-next", String(parseInt(next, 10) + 1));
      var rows = array.querySelector(":scope > .array-rows");
      rows.appendChild(row);
      var first = rows.lastElementChild.querySelector("input:not([type=hidden]), select");
      if (first) first.focus();
      return;
    }
    var remove = event.target.closest("[data-remove-row]");
    if (remove) {
      var fieldset = remove.closest("[data-array]");
      remove.closest(".array-row").remove();
      var again = fieldset.querySelector("[data-add-row]");
      if (again) again.focus();
    }
  });

  // <input data-select-all="form-id">: checks or clears every checkbox of that form.
  document.addEventListener("change", function (event) {
    var form = event.target.getAttribute("data-select-all");
    if (!form) return;
    document.querySelectorAll('input[form="' + form + '"]').forEach(function (box) {
      box.checked = event.target.checked;
    });
  });

  // <div data-chart='{json}'>: a bar chart drawn with uPlot (static/vendor/uplot), sized to
  // its box. "throughput": attempts per bucket, failed stacked on succeeded; "durations": one
  // bar per run, a click opens that run's instance.
  var COLORS = { ok: "#34b27d", bad: "#e0675d" };
  var HEIGHT = 150;

  function seconds(v) {
    if (v == null) return "—";
    if (v < 1) return Math.round(v * 1000) + " ms";
    if (v < 120) return (Math.round(v * 10) / 10) + " s";
    return Math.round(v / 60) + " min";
  }

  function clock(t, withDay) {
    var d = new Date(t * 1000);
    var hm = d.toLocaleTimeString(undefined, { hour: "2-digit", minute: "2-digit" });
    return withDay ? d.toLocaleDateString(undefined, { weekday: "short" }) + " " + hm : hm;
  }

  function second(t) {
    return new Date(t * 1000).toLocaleTimeString(undefined, { hour: "2-digit", minute: "2-digit", second: "2-digit" });
  }

  // Bars grow from zero, with a little headroom.
  function fromZero(u, min, max) { return [0, max > 0 ? max * 1.1 : 1]; }

  function options(spec, width) {
    var bars = uPlot.paths.bars({ size: [0.8, 40], gap: 1 });
    var series = [{}];
    var data;
    if (spec.kind === "throughput") {
      // Failed drawn as the total (succeeded + failed) behind succeeded: the part above
      // the green is the failures. The legend shows each series' own count.
      var ok = spec.series[0].values, bad = spec.series[1].values;
      var total = ok.map(function (v, i) { return v + bad[i]; });
      data = [spec.starts, total, ok];
      series.push({ label: "Failed", fill: COLORS.bad, stroke: COLORS.bad, width: 0, paths: bars,
                    points: { show: false }, value: function (u, v, s, i) { return i == null ? "—" : bad[i]; } });
      series.push({ label: "Succeeded", fill: COLORS.ok, stroke: COLORS.ok, width: 0, paths: bars,
                    points: { show: false } });
      var hourly = spec.per === "h";
      series[0] = { label: hourly ? "Hour" : "Minute", value: function (u, t) { return t == null ? "—" : clock(t, hourly); } };
      return [{
        width: width, height: HEIGHT, data: data, series: series, legend: { live: true },
        cursor: { points: { show: false }, drag: { x: false, y: false } },
        scales: { x: { time: true }, y: { range: fromZero } },
        axes: [{ space: 70, values: function (u, ticks) { return ticks.map(function (t) { return clock(t, false); }); } },
               { size: 40, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000] }]
      }, data];
    }
    // durations: x is the run's position (runs are not evenly spaced in time).
    var n = spec.links.length;
    var xs = spec.links.map(function (_, i) { return i; });
    data = [xs, spec.series[0].values, spec.series[1].values];
    spec.series.forEach(function (s) {
      series.push({ label: s.label, fill: COLORS[s.color], stroke: COLORS[s.color], width: 0,
                    paths: bars, points: { show: false }, value: function (u, v) { return seconds(v); } });
    });
    series[0] = { label: "Ended", value: function (u, i) { return i == null ? "—" : clock(spec.ends[i], true); } };
    return [{
      width: width, height: HEIGHT, data: data, series: series,
      cursor: { points: { show: false }, drag: { x: false, y: false } },
      scales: { x: { time: false, range: [-0.5, n - 0.5] }, y: { range: fromZero } },
      axes: [{ space: 90, values: function (u, ticks) {
                 return ticks.map(function (i) { return spec.ends[i] == null ? "" : second(spec.ends[i]); }); } },
             { size: 70, values: function (u, ticks) { return ticks.map(seconds); } }]
    }, data];
  }

  function drawOne(el) {
    if (typeof uPlot === "undefined" || el._chart) return;
    var spec = JSON.parse(el.getAttribute("data-chart"));
    var made = options(spec, Math.max(el.clientWidth, 200));
    var chart = new uPlot(made[0], made[1], el);
    el._chart = chart;
    if (spec.kind === "durations") {
      chart.over.style.cursor = "pointer";
      chart.over.addEventListener("click", function () {
        var i = chart.cursor.idx;
        if (i != null && spec.links[i]) window.location.href = spec.links[i];
      });
    }
  }

  function draw(root) { root.querySelectorAll("[data-chart]").forEach(drawOne); }

  function forget(root) {
    root.querySelectorAll("[data-chart]").forEach(function (el) {
      if (el._chart) { el._chart.destroy(); el._chart = null; }
    });
  }

  var resizing = null;
  window.addEventListener("resize", function () {
    clearTimeout(resizing);
    resizing = setTimeout(function () {
      document.querySelectorAll("[data-chart]").forEach(function (el) {
        if (el._chart) el._chart.setSize({ width: Math.max(el.clientWidth, 200), height: HEIGHT });
      });
    }, 150);
  });

  document.addEventListener("DOMContentLoaded", function () {
    localise(document);
    draw(document);
    document.querySelectorAll("[data-live]").forEach(live);
  });
})();
