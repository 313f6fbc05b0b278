(function(){
  var data = JSON.parse(document.getElementById('autotune-data').textContent);
  var config = {displaylogo:false, responsive:true, modeBarButtonsToRemove:['select2d','lasso2d']};
  // plotly.js is embedded gzip + base64 (see autotune/report.py); the browser unpacks it.
  function loadPlotly(){
    var packed = document.getElementById('plotly-js');
    if (!packed) return Promise.resolve(false);
    if (typeof DecompressionStream === 'undefined') return Promise.reject(new Error('no DecompressionStream'));
    var text = atob(packed.textContent.trim()), bytes = new Uint8Array(text.length);
    for (var i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    var stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'));
    return new Response(stream).text().then(function(code){
      var script = document.createElement('script');
      script.textContent = code;
      document.head.appendChild(script);  // runs now: defines window.Plotly
      return !!window.Plotly;
    });
  }
  loadPlotly().then(function(){
    return Promise.all(data.figures.map(function(fig){
      var el = document.getElementById('chart-' + fig.key);
      return el ? Plotly.newPlot(el, fig.data, fig.layout, config) : null;
    }));
  }).then(function(){ document.body.setAttribute('data-charts', 'drawn'); }, function(){
    document.querySelectorAll('div.chart').forEach(function(el){
      el.className = 'empty';
      el.textContent = 'This browser cannot unpack the embedded charting library (it needs DecompressionStream: ' +
                       'Chrome 80, Firefox 113, Safari 16.4 or later). The table above has every number.';
    });
    document.body.setAttribute('data-charts', 'failed');
  });
  // Sortable table: click a header; numbers sort as numbers, unmeasured cells ("-") always last.
  var table = document.getElementById('trials');
  if (table) {
    table.querySelectorAll('th').forEach(function(th, index){
      th.addEventListener('click', function(){
        var desc = !th.classList.contains('sorted-desc');
        table.querySelectorAll('th').forEach(function(h){ h.classList.remove('sorted-asc','sorted-desc'); });
        th.classList.add(desc ? 'sorted-desc' : 'sorted-asc');
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function(a, b){
          var x = a.cells[index].getAttribute('data-sort'), y = b.cells[index].getAttribute('data-sort');
          if (x === null || x === '') return (y === null || y === '') ? 0 : 1;
          if (y === null || y === '') return -1;
          var nx = parseFloat(x), ny = parseFloat(y), r;
          r = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
          return desc ? -r : r;
        });
        rows.forEach(function(r){ body.appendChild(r); });
      });
    });
  }
  document.querySelectorAll('button.copy').forEach(function(button){
    button.addEventListener('click', function(){
      var text = document.getElementById(button.getAttribute('data-target')).textContent;
      var done = function(){ button.textContent = 'copied'; setTimeout(function(){ button.textContent = 'copy'; }, 1500); };
      if (navigator.clipboard && window.isSecureContext) { navigator.clipboard.writeText(text).then(done, function(){}); }
      else { var area = document.createElement('textarea'); area.value = text; document.body.appendChild(area);
             area.select(); try { document.execCommand('copy'); done(); } catch (e) {} document.body.removeChild(area); }
    });
  });
})();
